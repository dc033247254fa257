// Config coop_128x256: cooperative persistent kernel, 128 x 256 CTA tile: 85 FLOP per byte loaded, against 64 for 128 x 128.
#include "sm90_gemm.cuh"

TCFM_CONFIG(coop_128x256, 128, 256, 1, 1, tcfm_cutlass::Schedule::kCooperative, true)
