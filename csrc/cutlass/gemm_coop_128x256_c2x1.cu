// Config coop_128x256_c2x1: the 128 x 256 cooperative kernel in 2 x 1 clusters: the two CTAs along M share each weight tile (TMA multicast).
#include "sm90_gemm.cuh"

TCFM_CONFIG(coop_128x256_c2x1, 128, 256, 2, 1, tcfm_cutlass::Schedule::kCooperative, true)
