// A small work-claiming thread pool for the decode kernels (instead of OpenMP's
// fork-join): the calling thread and the workers take chunks of a loop from one atomic
// counter, and the call returns as soon as every chunk is done. A worker that the OS
// has not scheduled yet (a loaded or oversubscribed host) finds the work gone and costs
// nothing: with fork-join every parallel region waits for every thread of the team
// (what that cost on a busy 2-core host: docs/benchmarks-log.md, "Measurement notes").
//
// Workers spin briefly between tasks (kSpinNs: a decode step issues its kernels back to
// back), then sleep on the task counter (futex), so between steps they leave the cores to
// the host's other threads. One task runs at a time; a second caller, from
// another thread, runs its loop alone instead of waiting.
#pragma once
#include <stdint.h>

namespace kvpool {

typedef void (*ChunkFn)(void* ctx, int64_t begin, int64_t end);

// Run fn(ctx, b, e) over [0, n) in chunks of `grain` on up to `nthreads` threads.
void parallel_for(int64_t n, int64_t grain, int nthreads, ChunkFn fn, void* ctx);

// The same with a lambda: parallel_for(n, grain, nt, [&](int64_t b, int64_t e) {...}).
template <typename F>
inline void parallel_for(int64_t n, int64_t grain, int nthreads, const F& f) {
  parallel_for(
      n, grain, nthreads, [](void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace kvpool
