// Test-only host emulation of the CUDA execution model, enough to run csrc/cuda/flash_kernels.cuh,
// unchanged, on the CPU with a host C++20 compiler.
//
//   __global__ / __device__ / __host__    nothing: kernels are plain functions
//   threadIdx, blockIdx, blockDim, gridDim thread_local, set for each emulated thread
//   one CUDA thread                        one fiber (ucontext) of the launching thread, switched at
//                                          barriers, resumed in an order drawn at random; blocks run
//                                          one after another. With CUDA_EMULATION_OS_THREADS defined
//                                          (the sanitizer builds): one std::thread, a block's threads
//                                          running concurrently
//   dynamic shared memory                  one buffer per block, filled with 0xFF bytes (NaN in
//                                          every float type) so reads of unwritten shared memory show
//   __syncthreads / __syncwarp            a barrier of the block's / the warp's threads
//   __shfl_xor_sync                        an exchange through per-warp memory between two barriers
//   nvcuda::wmma 16x16x16 fragments        each lane owns 8 elements of the tile (its own registers);
//                                          load/store touch only those, mma_sync gathers the warp's
//                                          fragments through per-warp memory, so a warp that does not
//                                          reach mma_sync together deadlocks as on the hardware
//
// The barriers are counting barriers (as std::barrier, including arrive-and-drop when a thread
// exits): a divergent __syncthreads becomes an error naming the deadlock instead of a hung test (with
// fibers as soon as no thread can run; with OS threads after a timeout), and a failure in one emulated
// thread unwinds all others of its block.
//
// Why fibers: a barrier of OS threads wakes each of its threads through the kernel, and mma_sync and
// every shuffle hold two warp barriers, so the emulated tests spent most of their time in futex wake-ups
// and context switches. A fiber switch stays in user space. Since fibers of one block never run at the same
// time, a missing barrier can only show through the order they run in: the order in which the waiting
// fibers resume is drawn at random at every phase (seeded by the block's index, so a failure repeats), so a
// read that no barrier orders after its write comes first in some threads. Races this order does not expose
// are ThreadSanitizer's; it sees races between OS threads only, hence CUDA_EMULATION_OS_THREADS in its build.
// WMMA's alignment rules (256-bit pointers, ldm a multiple of 16 bytes) are checked.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifndef CUDA_EMULATION_OS_THREADS
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <functional>
#endif

// cuda_fp16.h defines these for the host compiler; the kernels need them to vanish.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __align__
#define CUDA_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

namespace cuda_emulation {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// The largest dynamic shared memory of a block on any target (sm_90: 227 KB).
constexpr std::size_t kMaxSharedBytes = 227 * 1024;
// How long a barrier waits for the rest of its threads before it reports a deadlock.
inline std::chrono::milliseconds barrier_timeout{120000};

inline void require(bool condition, const std::string& message) {
  if (!condition) throw std::runtime_error("CUDA emulation: " + message);
}

// Thrown inside an emulated thread when another thread of its block failed: unwinds it.
struct Aborted {};

inline const char* const kDeadlock =
    "CUDA emulation: deadlock, not every thread reached the barrier "
    "(a __syncthreads, __syncwarp, shuffle or mma_sync in divergent code?)";

#ifdef CUDA_EMULATION_OS_THREADS
class Barrier {
 public:
  explicit Barrier(int count) : expected_(count) {}

  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (poisoned_) throw Aborted{};
    const std::uint64_t generation = generation_;
    if (++arrived_ >= expected_) {
      complete_phase();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + barrier_timeout;
    while (generation_ == generation) {
      if (poisoned_) throw Aborted{};
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation &&
          !poisoned_)
        throw std::runtime_error(kDeadlock);
    }
  }

  // A thread that exits no longer takes part (std::barrier::arrive_and_drop).
  void drop() {
    std::lock_guard<std::mutex> lock(mutex_);
    --expected_;
    if (arrived_ > 0 && arrived_ >= expected_) complete_phase();
  }

  void poison() {
    std::lock_guard<std::mutex> lock(mutex_);
    poisoned_ = true;
    cv_.notify_all();
  }

 private:
  void complete_phase() {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  int expected_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool poisoned_ = false;
};

#else

// The threads of one block as fibers of the launching thread. run() starts one fiber per thread and
// switches to a ready one whenever the running one parks (waits at a barrier) or returns; the next is
// drawn at random among the ready ones.
class Fibers {
 public:
  static constexpr std::size_t kStackBytes = 256 * 1024;

  explicit Fibers(unsigned count) : contexts_(count), stacks_(count) {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    for (auto& stack : stacks_) {
      // A page without access below each stack: an overflow faults instead of writing into the next one.
      void* memory = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      require(memory != MAP_FAILED, "no memory for the fibers' stacks");
      mprotect(memory, page, PROT_NONE);
      stack = {static_cast<char*>(memory), kStackBytes + page, page};
    }
  }

  ~Fibers() {
    for (const auto& stack : stacks_) munmap(stack.memory, stack.bytes);
  }

  Fibers(const Fibers&) = delete;
  Fibers& operator=(const Fibers&) = delete;

  // Runs body(t) for every thread t, each on its own fiber, until every one has returned. enter(t) is called
  // before each switch to fiber t (the thread's own state lives in this thread's thread_local variables).
  // `on_deadlock` is called when fibers wait and none is ready; it must wake them (by poisoning their barriers).
  void run(const std::function<void(unsigned)>& body, const std::function<void(unsigned)>& enter,
           const std::function<void()>& on_deadlock, std::uint32_t seed) {
    body_ = &body;
    order_.seed(seed);
    const unsigned count = static_cast<unsigned>(contexts_.size());
    ready_.clear();
    for (unsigned t = 0; t < count; ++t) {
      ucontext_t& context = contexts_[t];
      getcontext(&context);
      context.uc_stack.ss_sp = stacks_[t].memory + stacks_[t].guard;
      context.uc_stack.ss_size = kStackBytes;
      context.uc_link = &scheduler_;
      makecontext(&context, &Fibers::start, 0);
      ready_.push_back(t);
    }
    Fibers* const outer = current_;
    current_ = this;
    unsigned finished = 0;
    while (finished < count) {
      if (ready_.empty()) {
        on_deadlock();
        require(!ready_.empty(), "fibers wait that nothing can wake");
      }
      const std::size_t pick = std::uniform_int_distribution<std::size_t>(0, ready_.size() - 1)(order_);
      running_ = ready_[pick];
      ready_[pick] = ready_.back();
      ready_.pop_back();
      returned_ = false;
      enter(running_);
      swapcontext(&scheduler_, &contexts_[running_]);
      finished += returned_;
    }
    current_ = outer;
  }

  // The fibers of the block being run on this thread.
  static Fibers& current() {
    require(current_ != nullptr, "a barrier was reached outside a kernel launch");
    return *current_;
  }

  unsigned running() const { return running_; }

  // From a fiber: leaves the processor to the others until wake(running()).
  void park() { swapcontext(&contexts_[running_], &scheduler_); }

  void wake(unsigned fiber) { ready_.push_back(fiber); }

 private:
  struct Stack {
    char* memory;
    std::size_t bytes, guard;
  };

  static void start() {
    Fibers& self = *current_;
    (*self.body_)(self.running_);
    self.returned_ = true;  // back to the scheduler through uc_link
  }

  std::vector<ucontext_t> contexts_;
  std::vector<Stack> stacks_;
  ucontext_t scheduler_;
  const std::function<void(unsigned)>* body_ = nullptr;
  std::vector<unsigned> ready_;
  std::mt19937 order_;
  unsigned running_ = 0;
  bool returned_ = false;
  static inline thread_local Fibers* current_ = nullptr;
};

// A barrier of fibers: no lock (one fiber runs at a time); the fibers waiting at it are woken when the
// last one arrives, or when it is poisoned.
class Barrier {
 public:
  explicit Barrier(int count) : expected_(count) {}

  void arrive_and_wait() {
    if (poisoned_) throw Aborted{};
    if (++arrived_ >= expected_) {
      complete_phase();
      return;
    }
    Fibers& fibers = Fibers::current();
    waiting_.push_back(fibers.running());
    const std::uint64_t generation = generation_;
    while (generation_ == generation) {
      if (poisoned_) throw Aborted{};
      fibers.park();
    }
  }

  // A thread that exits no longer takes part (std::barrier::arrive_and_drop).
  void drop() {
    --expected_;
    if (arrived_ > 0 && arrived_ >= expected_) complete_phase();
  }

  void poison() {
    poisoned_ = true;
    wake_all();
  }

 private:
  void complete_phase() {
    arrived_ = 0;
    ++generation_;
    wake_all();
  }

  void wake_all() {
    if (waiting_.empty()) return;
    Fibers& fibers = Fibers::current();
    for (unsigned fiber : waiting_) fibers.wake(fiber);
    waiting_.clear();
  }

  int expected_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool poisoned_ = false;
  std::vector<unsigned> waiting_;
};
#endif

// What the lanes of one warp exchange through: the three operands of an mma_sync (as fp32, which
// holds fp16 and bf16 values exactly) and one value per lane for shuffles.
struct Warp {
  Barrier barrier{32};
  float a[256], b[256], c[256];
  std::uint64_t shuffle[32];
};

struct Block {
  Block(unsigned threads, std::size_t shared_bytes)
      : barrier(static_cast<int>(threads)), storage(shared_bytes + 128, 0xFF) {
    for (unsigned w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
    const auto address = reinterpret_cast<std::uintptr_t>(storage.data());
    shared = storage.data() + (128 - address % 128) % 128;
  }

  // The first failure is kept; every barrier of the block is poisoned so the others unwind.
  void fail(std::exception_ptr exception) {
    {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = exception;
    }
    barrier.poison();
    for (auto& warp : warps) warp->barrier.poison();
  }

  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<unsigned char> storage;
  unsigned char* shared;
  std::mutex error_mutex;
  std::exception_ptr error;
};

inline thread_local Block* current_block = nullptr;

inline Block& block() {
  require(current_block != nullptr, "a device function was called outside a kernel launch");
  return *current_block;
}

}  // namespace cuda_emulation

inline thread_local cuda_emulation::Dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace cuda_emulation {

inline Warp& warp() { return *block().warps[threadIdx.x / 32]; }
inline unsigned lane() { return threadIdx.x % 32; }

// Runs `kernel` over the grid: for each block in turn, one fiber (or std::thread) per CUDA thread.
template <typename Params>
void launch(void (*kernel)(Params), Dim3 grid, Dim3 block_shape, std::size_t shared_bytes,
            const Params& params) {
  require(block_shape.y == 1 && block_shape.z == 1, "only one-dimensional blocks are emulated");
  require(block_shape.x > 0 && block_shape.x <= 1024 && block_shape.x % 32 == 0,
          "the block size must be a multiple of the warp size, at most 1024");
  require(shared_bytes <= kMaxSharedBytes, "dynamic shared memory beyond 227 KB");
#ifndef CUDA_EMULATION_OS_THREADS
  Fibers fibers(block_shape.x);
#endif
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        Block state(block_shape.x, shared_bytes);
        const auto thread_body = [&](unsigned t) {
          threadIdx = Dim3{t, 0, 0};
          blockIdx = Dim3{x, y, z};
          blockDim = block_shape;
          gridDim = grid;
          current_block = &state;
          try {
            kernel(params);
          } catch (const Aborted&) {
          } catch (...) {
            state.fail(std::current_exception());
          }
          state.barrier.drop();
          state.warps[t / 32]->barrier.drop();
          current_block = nullptr;
        };
#ifdef CUDA_EMULATION_OS_THREADS
        std::vector<std::thread> threads;
        threads.reserve(block_shape.x);
        for (unsigned t = 0; t < block_shape.x; ++t) threads.emplace_back(thread_body, t);
        for (auto& thread : threads) thread.join();
#else
        const auto enter = [&](unsigned t) {
          threadIdx = Dim3{t, 0, 0};
          current_block = &state;
        };
        const auto deadlock = [&] { state.fail(std::make_exception_ptr(std::runtime_error(kDeadlock))); };
        fibers.run(thread_body, enter, deadlock, (z * grid.y + y) * grid.x + x);
#endif
        if (state.error) std::rethrow_exception(state.error);
      }
    }
  }
}

}  // namespace cuda_emulation

// ---- the device-side names the kernels use -----------------------------------------------------

inline unsigned char* dynamic_shared_memory() { return cuda_emulation::block().shared; }

inline void __syncthreads() { cuda_emulation::block().barrier.arrive_and_wait(); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_emulation::require(mask == 0xffffffffu, "__syncwarp: only the full-warp mask is emulated");
  cuda_emulation::warp().barrier.arrive_and_wait();
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move up to 8 bytes");
  using cuda_emulation::require;
  require(mask == 0xffffffffu, "__shfl_xor_sync: only the full-warp mask is emulated");
  require(width > 0 && width <= 32 && (width & (width - 1)) == 0,
          "__shfl_xor_sync: width must be a power of two up to 32");
  auto& warp = cuda_emulation::warp();
  const unsigned lane = cuda_emulation::lane();
  unsigned source = lane ^ static_cast<unsigned>(lane_mask);
  if (source >= 32 || source / width != lane / width) source = lane;  // outside its segment
  warp.barrier.arrive_and_wait();  // every lane has read the previous exchange
  std::memcpy(&warp.shuffle[lane], &value, sizeof(T));
  warp.barrier.arrive_and_wait();  // every lane has written
  T result;
  std::memcpy(&result, &warp.shuffle[source], sizeof(T));
  return result;
}

// ---- WMMA ----------------------------------------------------------------------------------------

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

// Lane L holds the tile elements L + 32 e (e < 8) in row-major order: (row, column) of A (m, k),
// of B (k, n), of the accumulator (m, n).
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation provides 16x16x16 fragments");

 public:
  static constexpr int num_elements = 8;
  T x[num_elements];
};

namespace detail {

inline float to_float(float x) { return x; }
inline float to_float(__half x) { return __half2float(x); }
inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
void check_operand(const T* pointer, unsigned ldm, const char* what) {
  using cuda_emulation::require;
  require(reinterpret_cast<std::uintptr_t>(pointer) % 32 == 0,
          std::string(what) + ": the pointer must be 256-bit aligned");
  require(ldm * sizeof(T) % 16 == 0 && ldm >= 16,
          std::string(what) + ": ldm must be a multiple of 16 bytes, at least 16 elements");
}

inline int row_of(int e) { return static_cast<int>(cuda_emulation::lane() + 32 * e) / 16; }
inline int col_of(int e) { return static_cast<int>(cuda_emulation::lane() + 32 * e) % 16; }

}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* pointer, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "accumulators are loaded with a layout_t");
  detail::check_operand(pointer, ldm, "load_matrix_sync");
  constexpr bool col = std::is_same_v<Layout, col_major>;
  for (int e = 0; e < f.num_elements; ++e) {
    const int r = detail::row_of(e), c = detail::col_of(e);
    f.x[e] = col ? pointer[c * ldm + r] : pointer[r * ldm + c];
  }
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* pointer, unsigned ldm,
                      layout_t layout) {
  detail::check_operand(pointer, ldm, "load_matrix_sync");
  for (int e = 0; e < f.num_elements; ++e) {
    const int r = detail::row_of(e), c = detail::col_of(e);
    f.x[e] = layout == mem_col_major ? pointer[c * ldm + r] : pointer[r * ldm + c];
  }
}

template <int M, int N, int K>
void store_matrix_sync(float* pointer, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout) {
  detail::check_operand(pointer, ldm, "store_matrix_sync");
  for (int e = 0; e < f.num_elements; ++e) {
    const int r = detail::row_of(e), c = detail::col_of(e);
    (layout == mem_col_major ? pointer[c * ldm + r] : pointer[r * ldm + c]) = f.x[e];
  }
}

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  for (int e = 0; e < f.num_elements; ++e) f.x[e] = static_cast<T>(value);
}

// D = A B + C over the warp: products of fp16/bf16 values are exact in fp32, summed in fp32.
template <int M, int N, int K, typename T, typename LayoutA, typename LayoutB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LayoutA>& a,
              const fragment<matrix_b, M, N, K, T, LayoutB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "the emulated tensor cores take fp16 or bf16 operands");
  auto& warp = cuda_emulation::warp();
  const unsigned lane = cuda_emulation::lane();
  warp.barrier.arrive_and_wait();  // every lane is done with the previous mma_sync
  for (int e = 0; e < 8; ++e) {
    const unsigned index = lane + 32 * e;
    warp.a[index] = detail::to_float(a.x[e]);
    warp.b[index] = detail::to_float(b.x[e]);
    warp.c[index] = c.x[e];
  }
  warp.barrier.arrive_and_wait();  // the whole warp's fragments are gathered
  for (int e = 0; e < 8; ++e) {
    const int r = detail::row_of(e), n = detail::col_of(e);
    float sum = warp.c[r * 16 + n];
    for (int k = 0; k < 16; ++k) sum += warp.a[r * 16 + k] * warp.b[k * 16 + n];
    d.x[e] = sum;
  }
}

}  // namespace wmma
}  // namespace nvcuda
