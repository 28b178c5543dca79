// kvpool::parallel_for (pool.h).
//
// One 64-bit word describes the running task and hands out its chunks:
//   work = seq (24 bits) | chunks (20 bits) | next chunk (20 bits)
// A claim is one fetch_add(1): it returns which task the chunk belongs to, how many
// chunks that task has and the chunk's index. A claim below `chunks` is a real chunk of
// a task that is still running (its caller waits until every chunk is done), so the
// task's parameters, written before the word, are still valid; a claim at or past
// `chunks` is no work, whatever task it names. Nothing of a task lives on after its
// call returns, so a worker that wakes late can never touch a finished one.

#include "kvkernels.h"
#include "pool.h"

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace kvpool {
namespace {

constexpr int kNextBits = 20, kChunkBits = 20;
constexpr uint64_t kMask = (1u << 20) - 1;
constexpr int64_t kMaxChunks = (1 << 20) - 1024;
constexpr int64_t kSpinNs = 500000;  // how long an idle worker spins before it sleeps (see worker)

struct Pool {
  std::mutex busy;                   // one task at a time (the caller's thread runs in it too)
  std::atomic<uint64_t> work{0};     // see above
  std::atomic<int64_t> done{0};      // chunks of the running task finished
  std::atomic<uint32_t> wake{0};     // bumped per task: sleeping workers wait on it
  std::atomic<int> limit{0};         // workers with index < limit join the running task
  // the running task (written before `work` announces it)
  ChunkFn fn = nullptr;
  void* ctx = nullptr;
  int64_t n = 0, grain = 1;
  uint64_t seq = 0;
  std::vector<std::thread> workers;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: parked workers outlive static destruction
  return *p;
}

// Claim and run chunks until the task has none left.
void run_chunks(Pool* p) {
  for (;;) {
    const uint64_t w = p->work.fetch_add(1, std::memory_order_acq_rel);
    const int64_t chunks = (int64_t)((w >> kNextBits) & kMask), c = (int64_t)(w & kMask);
    if (c >= chunks) return;
    const int64_t b = c * p->grain;
    const int64_t e = b + p->grain < p->n ? b + p->grain : p->n;
    p->fn(p->ctx, b, e);
    p->done.fetch_add(1, std::memory_order_release);
  }
}

void worker(Pool* p, int index) {
  uint32_t seen = p->wake.load(std::memory_order_acquire);
  for (;;) {
    // spin for kSpinNs, then sleep. A decode step issues its kernels back to back (a
    // layer's products inside one call, layers microseconds apart), and between two steps
    // the caller's thread runs the engine's Python for 0.1-0.3 ms (planning, sampling,
    // the output): a worker that slept there costs the next step's first kernels their
    // second thread while it wakes (measured: docs/benchmarks-log.md, "Measurement notes").
    // Longer than that the engine is idle or waiting on something else,
    // and a spinning worker would take the core the host's other threads need.
    uint32_t now;
    int spins = 0;
    auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNs);
    while ((now = p->wake.load(std::memory_order_acquire)) == seen) {
      if ((++spins & 63) || std::chrono::steady_clock::now() < until)
        _mm_pause();
      else
        p->wake.wait(seen, std::memory_order_acquire);
    }
    seen = now;
    if (index < p->limit.load(std::memory_order_acquire)) run_chunks(p);
  }
}

}  // namespace

void parallel_for(int64_t n, int64_t grain, int nthreads, ChunkFn fn, void* ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if ((n + grain - 1) / grain > kMaxChunks) grain = (n + kMaxChunks - 1) / kMaxChunks;
  const int64_t chunks = (n + grain - 1) / grain;
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.busy, std::try_to_lock);
  if (nthreads <= 1 || chunks == 1 || !lock.owns_lock()) {  // busy: another thread's task runs; go alone
    fn(ctx, 0, n);
    return;
  }
  while ((int)p.workers.size() < nthreads - 1) {
    p.workers.emplace_back(worker, &p, (int)p.workers.size());
    p.workers.back().detach();
  }
  p.fn = fn;
  p.ctx = ctx;
  p.n = n;
  p.grain = grain;
  p.seq = (p.seq + 1) & 0xFFFFFF;
  p.done.store(0, std::memory_order_relaxed);
  p.limit.store(nthreads - 1, std::memory_order_relaxed);
  p.work.store((p.seq << (kNextBits + kChunkBits)) | ((uint64_t)chunks << kNextBits), std::memory_order_release);
  p.wake.fetch_add(1, std::memory_order_release);
  p.wake.notify_all();
  run_chunks(&p);
  while (p.done.load(std::memory_order_acquire) < chunks) _mm_pause();  // chunks still running elsewhere
}

}  // namespace kvpool
