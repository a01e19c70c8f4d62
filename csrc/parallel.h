// Work items handed out to the threads as each becomes free (a dynamic schedule) instead of at::parallel_for's equal
// ranges (a static one). With ranges, a region ends when its slowest thread does, and on a shared machine the
// threads' speeds differ from one moment to the next. An item's result does not depend on the thread that computes
// it: the outputs are the same floats whichever thread takes which item.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvcache {

// Items 0 .. n-1, handed out in runs of consecutive ones, each item once, in increasing order within a thread:
// OpenMP's guided schedule, each run a 2T-th of what is left (T threads), down to one item. The first runs are
// as long as a static schedule's halves, so that each thread reads long sequential streams (a layer's weight
// panels), and the short last ones keep the threads finishing together (docs/kernels.md).
class ItemPool {
 public:
  ItemPool(int64_t n, int64_t threads) : n_(n), parts_(2 * threads) {}
  // Takes the next run into [first, end); false when no item is left
  bool take(int64_t& first, int64_t& end) {
    int64_t at = next_.load(std::memory_order_relaxed);
    for (;;) {
      if (at >= n_) return false;
      const int64_t run = (n_ - at + parts_ - 1) / parts_;
      if (next_.compare_exchange_weak(at, std::min(n_, at + run), std::memory_order_relaxed)) {
        first = at;
        end = std::min(n_, at + run);
        return true;
      }
    }
  }

 private:
  const int64_t n_, parts_;
  std::atomic<int64_t> next_{0};
};

// One thread's view of an ItemPool: take() gives its next item, or -1 when none is left.
class WorkQueue {
 public:
  explicit WorkQueue(ItemPool& pool) : pool_(pool) {}
  int64_t take() {
    if (i_ == end_ && !pool_.take(i_, end_)) return -1;
    return i_++;
  }
  // f(i, next) for each item i this thread takes, `next` being the one it takes after i (-1: none), for what it
  // reads ahead: the thread holds one item taken ahead of the one it works on
  template <class F>
  void each(const F& f) {
    for (int64_t i = take(), next; i >= 0; i = next) {
      next = take();
      f(i, next);
    }
  }

 private:
  ItemPool& pool_;
  int64_t i_ = 0, end_ = 0;
};

// worker(queue) on each of at most at::get_num_threads() threads (one, serially, inside a parallel region), each
// taking items of n from its own WorkQueue over one pool until none is left; a worker sets up what it keeps between
// items (buffers) once.
template <class Worker>
void parallel_items(int64_t n, const Worker& worker) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::in_parallel_region() ? 1 : at::get_num_threads(), n);
  ItemPool pool(n, threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    WorkQueue queue(pool);
    worker(queue);
  });
}

// f(i, next) for every item i of n, as WorkQueue::each gives them.
template <class F>
void parallel_each(int64_t n, const F& f) {
  parallel_items(n, [&](WorkQueue& q) { q.each(f); });
}

}  // namespace kvcache
