// Config streamk_128x256: stream-K cooperative kernel, 128 x 256 tile.
// CUTLASS 4.2's stream-K scheduler does not compile with CUTLASS_ENABLE_GDC_FOR_SM90 (its const
// is_last_tile, called only for the early trigger, binds a member to a non-const reference). Keep the
// griddepcontrol.wait of a PDL launch, drop the early trigger: dependents launch as the kernel ends.
#undef CUTLASS_ENABLE_GDC_FOR_SM90
#define CUTLASS_GDC_ENABLED
#include "sm90_gemm.cuh"

TCFM_CONFIG(streamk_128x256, 128, 256, 1, 1, tcfm_cutlass::Schedule::kStreamK, true)
