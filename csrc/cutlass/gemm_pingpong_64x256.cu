// Config pingpong_64x256: ping-pong persistent kernel, 64 x 256 tile per consumer warpgroup: the 64-row
// tile with twice the FLOP per A byte (150 qkv tiles and 200 fc1 tiles at M = 1,600).
#include "sm90_gemm.cuh"

TCFM_CONFIG(pingpong_64x256, 64, 256, 1, 1, tcfm_cutlass::Schedule::kPingpong, true)
