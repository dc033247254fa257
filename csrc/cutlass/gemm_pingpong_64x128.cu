// Config pingpong_64x128: ping-pong persistent kernel, 64 x 128 tile per consumer warpgroup: at 32 rows
// (M = 1,600) 300 tiles for qkv and 400 for fc1 over 132 SMs, where 128-row tiles leave the last wave mostly idle.
#include "sm90_gemm.cuh"

TCFM_CONFIG(pingpong_64x128, 64, 128, 1, 1, tcfm_cutlass::Schedule::kPingpong, true)
