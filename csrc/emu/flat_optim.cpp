// The CUDA flat-buffer optimizer kernels and their launchers, compiled by the host compiler for
// the SIMT emulator (emu.h); built into bertdist._C_emu and the check driver.
#include "../cuda_flat_optim.cu"
