// Config pingpong_128x128: ping-pong persistent kernel, 128 x 128 tile per consumer warpgroup: one warpgroup's epilogue runs under the other's main loop.
#include "sm90_gemm.cuh"

TCFM_CONFIG(pingpong_128x128, 128, 128, 1, 1, tcfm_cutlass::Schedule::kPingpong, true)
