// Chunk -> segment lookup of the flat-buffer optimizers (FlatSegments, ops.h), shared by the
// CPU twin and the CUDA kernels so that both cut the buffers into the same chunks.
#pragma once
#include <cstdint>

#include "ops.h"

#if defined(__CUDACC__)
#define BD_FLAT_HD __host__ __device__ __forceinline__
#else
#define BD_FLAT_HD inline
#endif

namespace bertdist {

struct ChunkRange {
  int64_t seg, begin, end;  // elements begin .. end of segment seg
};

// The last segment whose first chunk is <= chunk: empty segments own no chunk, so ties resolve
// to the segment that does own it.
BD_FLAT_HD int64_t segment_of_chunk(const FlatSegments& s, int64_t chunk) {
  int64_t lo = 0, hi = s.segments;  // chunk_offsets[lo] <= chunk; the answer is below hi
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (s.chunk_offsets[mid] <= chunk)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

BD_FLAT_HD ChunkRange chunk_range(const FlatSegments& s, int64_t chunk) {
  const int64_t seg = segment_of_chunk(s, chunk);
  const int64_t begin = s.offsets[seg] + (chunk - s.chunk_offsets[seg]) * s.chunk_size;
  const int64_t end = begin + s.chunk_size < s.offsets[seg + 1] ? begin + s.chunk_size : s.offsets[seg + 1];
  return {seg, begin, end};
}

// The global-norm clip coefficient, torch.nn.utils.clip_grad_norm_'s: max_norm <= 0 disables it.
BD_FLAT_HD float clip_coefficient(float norm, float max_norm) {
  if (max_norm <= 0.f) return 1.f;
  const float c = max_norm / (norm + 1e-6f);
  return c < 1.f ? c : 1.f;
}

}  // namespace bertdist
