// Runtime of the Metal emulator: runs the threads of a dispatch as fibers.
//
// Each threadgroup runs on one worker (an OS thread); its threads are fibers
// that run until they reach a SIMD collective, a threadgroup barrier, or their
// end. When no fiber of the group can run, the scheduler completes the
// collectives whose lanes have all arrived (one call site per simdgroup at a
// time), then releases the barrier once every live thread waits at it.
//
// Built once into libmtlemu_rt-<hash>.so and loaded RTLD_GLOBAL, so that the
// kernel libraries resolve the emu_rt_* calls against it.

#include "emu_abi.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if !defined(__x86_64__) || defined(EMU_USE_UCONTEXT)
#define EMU_UCONTEXT 1
#include <ucontext.h>
#endif

namespace {

constexpr int kMaxThreads = 1024;
constexpr int kKeyDepth = 16;
constexpr uint64_t kThreadgroupMemory = 32768;

enum State { RUNNABLE, AT_SIMD, AT_BARRIER, DONE };

struct Fiber {
#ifdef EMU_UCONTEXT
  ucontext_t uc;
#else
  void* sp;
#endif
  int state;
  emu_attrs attrs;
  const void* in;
  void* out;
  emu_simd_fn fn;
  int keyn;
  uintptr_t key[kKeyDepth];
  char* stack_lo;
  char* stack_hi;
};

struct Launch {
  emu_entry_fn entry;
  const char* name;
  uint32_t grid[3], tg[3], ntg[3];
  uint64_t total_groups;
  int32_t n_bufs;
  const emu_buf* bufs;
  const void* const* scalars;
  int32_t schedule;  // emu_launch's mode bits
  uint64_t stack_size;
  std::atomic<uint64_t> next_group{0};
  std::atomic<int> failed{0};
  std::mutex error_mu;
  int error_code = EMU_OK;
  std::string error;
};

struct StackRegion {
  char* mem = nullptr;
  size_t stride = 0;  // guard page + stack
  size_t total = 0;
};

struct Worker {
  Launch* L = nullptr;
  std::vector<emu_buf> bufs;
  std::vector<Fiber> fibers;
  StackRegion stacks;
#ifdef EMU_UCONTEXT
  ucontext_t sched_uc;
#else
  void* sched_sp = nullptr;
#endif
  Fiber* current = nullptr;
  volatile int in_fiber = 0;
  uint64_t tg_gen = 0;
  uint64_t tg_bytes = 0;
  uint32_t group_pos[3] = {0, 0, 0};
  uint32_t group_size[3] = {0, 0, 0};
  int n = 0;
  uint64_t counters[EMU_CNT_N] = {};
};

__thread Worker* tl_worker __attribute__((tls_model("initial-exec"))) = nullptr;

std::atomic<uint64_t> g_generation{0};
size_t g_page = 4096;

// ---------------------------------------------------------------------------
// Context switching

#ifndef EMU_UCONTEXT
extern "C" void emu_switch_ctx(void** save_sp, void* to_sp)
    __attribute__((visibility("hidden")));
extern "C" void emu_fiber_trampoline() __attribute__((visibility("hidden")));
extern "C" void emu_fiber_main(Fiber* f) __attribute__((visibility("hidden")));

// Saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer in *save_sp and resumes to_sp.
asm(R"(
    .text
    .globl emu_switch_ctx
    .hidden emu_switch_ctx
    .type emu_switch_ctx,@function
emu_switch_ctx:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_ctx, .-emu_switch_ctx

    .globl emu_fiber_trampoline
    .hidden emu_fiber_trampoline
    .type emu_fiber_trampoline,@function
emu_fiber_trampoline:
    movq %r12, %rdi
    andq $-16, %rsp
    call emu_fiber_main
    ud2
    .size emu_fiber_trampoline, .-emu_fiber_trampoline
)");

void fiber_init(Worker*, Fiber* f) {
  uintptr_t top = reinterpret_cast<uintptr_t>(f->stack_hi) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                            // padding
  *--sp = reinterpret_cast<void*>(&emu_fiber_trampoline);     // return address
  *--sp = nullptr;                                            // rbp: ends the frame chain
  *--sp = nullptr;                                            // rbx
  *--sp = f;                                                  // r12: the fiber
  *--sp = nullptr;                                            // r13
  *--sp = nullptr;                                            // r14
  *--sp = nullptr;                                            // r15
  *--sp = reinterpret_cast<void*>(uintptr_t(0x1F80) | (uintptr_t(0x037F) << 32));
  f->sp = sp;
}

inline void fiber_resume(Worker* w, Fiber* f) { emu_switch_ctx(&w->sched_sp, f->sp); }
inline void fiber_yield(Worker* w, Fiber* f) { emu_switch_ctx(&f->sp, w->sched_sp); }

#else

extern "C" void emu_fiber_main(Fiber* f);

void fiber_entry_uc() { emu_fiber_main(tl_worker->current); }

void fiber_init(Worker* w, Fiber* f) {
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack_lo;
  f->uc.uc_stack.ss_size = f->stack_hi - f->stack_lo;
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, fiber_entry_uc, 0);
  (void)w;
}

inline void fiber_resume(Worker* w, Fiber* f) { swapcontext(&w->sched_uc, &f->uc); }
inline void fiber_yield(Worker* w, Fiber* f) { swapcontext(&f->uc, &w->sched_uc); }

#endif

// ---------------------------------------------------------------------------
// Errors

void set_error(Launch* L, int code, const std::string& msg) {
  std::lock_guard<std::mutex> lock(L->error_mu);
  if (L->error_code == EMU_OK) {
    L->error_code = code;
    L->error = msg;
  }
  L->failed.store(1);
}

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof(buf), f, ap);
  va_end(ap);
  return buf;
}

std::string where(const Fiber* f) {
  const emu_attrs& a = f->attrs;
  return fmt(
      "thread_position_in_grid=(%u, %u, %u) [threadgroup (%u, %u, %u), "
      "simdgroup %u, lane %u]",
      a.thread_position_in_grid[0], a.thread_position_in_grid[1],
      a.thread_position_in_grid[2], a.threadgroup_position_in_grid[0],
      a.threadgroup_position_in_grid[1], a.threadgroup_position_in_grid[2],
      a.simdgroup_index_in_threadgroup, a.thread_index_in_simdgroup);
}

// Ends the current fiber for good: the launch has failed.
[[noreturn]] void abandon(Worker* w) {
  Fiber* f = w->current;
  f->state = DONE;
  fiber_yield(w, f);
  __builtin_trap();
}

// ---------------------------------------------------------------------------
// Fiber stacks, reused across launches

std::mutex g_pool_mu;
std::vector<StackRegion> g_pool;

StackRegion take_stacks(size_t stack_size) {
  size_t stride = g_page + ((stack_size + g_page - 1) / g_page) * g_page;
  {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    for (size_t i = 0; i < g_pool.size(); i++) {
      if (g_pool[i].stride == stride) {
        StackRegion r = g_pool[i];
        g_pool.erase(g_pool.begin() + i);
        return r;
      }
    }
  }
  StackRegion r;
  r.stride = stride;
  r.total = stride * kMaxThreads;
  void* mem = mmap(nullptr, r.total, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    r.mem = nullptr;
    return r;
  }
  r.mem = static_cast<char*>(mem);
  for (int i = 0; i < kMaxThreads; i++) {
    mprotect(r.mem + i * stride, g_page, PROT_NONE);  // guard page below each stack
  }
  return r;
}

void give_stacks(const StackRegion& r) {
  if (!r.mem) return;
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_pool.push_back(r);
}

// ---------------------------------------------------------------------------
// Signals: a crash inside a fiber fails the launch instead of the process.

std::mutex g_sig_mu;
int g_sig_users = 0;
const int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction g_old_actions[4];

void on_signal(int sig, siginfo_t* si, void*) {
  Worker* w = tl_worker;
  if (!w || !w->in_fiber || !w->current) {
    // Not ours: put the previous handler back and let the fault recur.
    for (int i = 0; i < 4; i++) {
      if (kSignals[i] == sig) sigaction(sig, &g_old_actions[i], nullptr);
    }
    return;
  }
  Fiber* f = w->current;
  char* addr = static_cast<char*>(si->si_addr);
  const char* what = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS"
                   : sig == SIGFPE ? "SIGFPE" : "SIGILL";
  std::string why;
  if ((sig == SIGSEGV || sig == SIGBUS) && addr >= f->stack_lo - g_page &&
      addr < f->stack_lo) {
    why = fmt("stack overflow: a thread used more than %llu bytes of stack "
              "(large local arrays?); raise MLX_TERNARY_EMULATOR_STACK",
              (unsigned long long)(f->stack_hi - f->stack_lo));
  } else if (sig == SIGFPE) {
    why = "integer division by zero or overflow";
  } else {
    why = fmt("invalid memory access at %p (through a raw pointer: "
              "thread/threadgroup memory or a pointer cast)", addr);
  }
  set_error(w->L, EMU_ERR_CRASH,
            fmt("kernel '%s' crashed with %s in %s: %s", w->L->name, what,
                where(f).c_str(), why.c_str()));
  w->in_fiber = 0;
  abandon(w);
}

void install_signals() {
  std::lock_guard<std::mutex> lock(g_sig_mu);
  if (g_sig_users++ > 0) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < 4; i++) sigaction(kSignals[i], &sa, &g_old_actions[i]);
}

void restore_signals() {
  std::lock_guard<std::mutex> lock(g_sig_mu);
  if (--g_sig_users > 0) return;
  for (int i = 0; i < 4; i++) sigaction(kSignals[i], &g_old_actions[i], nullptr);
}

// ---------------------------------------------------------------------------
// Scheduling

// Orders call sites by their return addresses, outermost frame first. Kernels
// are built so that code comes in source order (see build.py), so among lanes
// of a simdgroup waiting at different calls, those behind in the program (in
// the `if` body, in the loop, inside a helper) run first: the "MinSP-PC" rule
// of SIMT simulators. It is exact for if/else and loop exits, not for a lane
// that re-enters a loop while another finishes a later branch of the body.
int key_cmp(const Fiber* a, const Fiber* b) {
  int na = a->keyn, nb = b->keyn;
  for (int i = 0; i < std::min(na, nb); i++) {
    uintptr_t x = a->key[na - 1 - i], y = b->key[nb - 1 - i];
    if (x != y) return x < y ? -1 : 1;
  }
  return na == nb ? 0 : (na < nb ? -1 : 1);
}

void init_fiber_attrs(Worker* w, Fiber* f, int li) {
  Launch* L = w->L;
  emu_attrs& a = f->attrs;
  const uint32_t* s = w->group_size;
  uint32_t l[3] = {li % s[0], (li / s[0]) % s[1], li / (s[0] * s[1])};
  uint32_t dispatch = L->tg[0] * L->tg[1] * L->tg[2];
  for (int d = 0; d < 3; d++) {
    a.thread_position_in_grid[d] = w->group_pos[d] * L->tg[d] + l[d];
    a.thread_position_in_threadgroup[d] = l[d];
    a.threadgroup_position_in_grid[d] = w->group_pos[d];
    a.threads_per_threadgroup[d] = s[d];
    a.dispatch_threads_per_threadgroup[d] = L->tg[d];
    a.threadgroups_per_grid[d] = L->ntg[d];
    a.threads_per_grid[d] = L->grid[d];
  }
  a.thread_index_in_threadgroup = li;
  a.thread_index_in_simdgroup = li % 32;
  a.simdgroup_index_in_threadgroup = li / 32;
  a.simdgroups_per_threadgroup = (w->n + 31) / 32;
  a.dispatch_simdgroups_per_threadgroup = (dispatch + 31) / 32;
  a.thread_index_in_quadgroup = li % 4;
  a.quadgroup_index_in_threadgroup = li / 4;
  a.quadgroups_per_threadgroup = (w->n + 3) / 4;
  a.dispatch_quadgroups_per_threadgroup = (dispatch + 3) / 4;
}

void run_fiber(Worker* w, Fiber* f) {
  w->current = f;
  w->in_fiber = 1;
  fiber_resume(w, f);
  w->in_fiber = 0;
  w->counters[EMU_CNT_SWITCHES]++;
}

void run_group(Worker* w, uint64_t index) {
  Launch* L = w->L;
  uint64_t rest = index;
  int n = 1;
  for (int d = 0; d < 3; d++) {
    w->group_pos[d] = static_cast<uint32_t>(rest % L->ntg[d]);
    rest /= L->ntg[d];
    w->group_size[d] = std::min(L->tg[d], L->grid[d] - w->group_pos[d] * L->tg[d]);
    n *= w->group_size[d];
  }
  w->n = n;
  w->tg_gen = ++g_generation;
  w->tg_bytes = 0;
  for (int li = 0; li < n; li++) {
    Fiber* f = &w->fibers[li];
    f->stack_lo = w->stacks.mem + li * w->stacks.stride + g_page;
    f->stack_hi = w->stacks.mem + (li + 1) * w->stacks.stride;
    f->state = RUNNABLE;
    init_fiber_attrs(w, f, li);
    fiber_init(w, f);
  }
  w->counters[EMU_CNT_THREADS] += n;
  int n_simd = (n + 31) / 32;
  for (;;) {
    for (int k = 0; k < n; k++) {
      int li = (L->schedule & 1) ? n - 1 - k : k;
      Fiber* f = &w->fibers[li];
      if (f->state != RUNNABLE) continue;
      run_fiber(w, f);
      if (L->failed.load(std::memory_order_relaxed)) return;
    }
    bool progressed = false;
    for (int sg = 0; sg < n_simd; sg++) {
      int lo = sg * 32, hi = std::min(n, lo + 32);
      Fiber* best = nullptr;
      bool at_barrier = false;
      for (int li = lo; li < hi; li++) {
        Fiber* f = &w->fibers[li];
        if (f->state == AT_BARRIER) at_barrier = true;
        if (f->state == AT_SIMD && (!best || key_cmp(f, best) < 0)) best = f;
      }
      if (!best) continue;
      emu_simd_group g;
      g.mask = 0;
      g.width = hi - lo;
      bool divergent = at_barrier;
      for (int li = lo; li < hi; li++) {
        Fiber* f = &w->fibers[li];
        g.in[li - lo] = nullptr;
        g.out[li - lo] = nullptr;
        if (f->state != AT_SIMD) continue;
        if (key_cmp(f, best) != 0) {
          divergent = true;
          continue;
        }
        g.mask |= 1u << (li - lo);
        g.in[li - lo] = f->in;
        g.out[li - lo] = f->out;
        f->state = RUNNABLE;
      }
      if (divergent && (L->schedule & 2)) {
        uint32_t elsewhere = 0;
        for (int li = lo; li < hi; li++) {
          int st = w->fibers[li].state;
          if ((st == AT_SIMD || st == AT_BARRIER) && !((g.mask >> (li - lo)) & 1))
            elsewhere |= 1u << (li - lo);
        }
        set_error(L, EMU_ERR_KERNEL,
                  fmt("kernel '%s': divergent SIMD-group operation in simdgroup %d of "
                      "threadgroup (%u, %u, %u): lanes 0x%08x reached one call while "
                      "lanes 0x%08x wait at another call or a barrier",
                      L->name, sg, w->group_pos[0], w->group_pos[1], w->group_pos[2],
                      g.mask, elsewhere));
        return;
      }
      if (best->fn) {
        if (const char* msg = best->fn(&g)) {
          set_error(L, EMU_ERR_KERNEL,
                    fmt("kernel '%s': %s in %s", L->name, msg, where(best).c_str()));
          return;
        }
      }
      w->counters[EMU_CNT_SIMD_OPS]++;
      if (divergent) w->counters[EMU_CNT_DIVERGENT_OPS]++;
      progressed = true;
    }
    if (progressed) continue;
    bool waiting = false;
    for (int li = 0; li < n; li++) {
      Fiber* f = &w->fibers[li];
      if (f->state == AT_BARRIER) {
        f->state = RUNNABLE;
        waiting = true;
      }
    }
    if (!waiting) break;
    w->counters[EMU_CNT_BARRIERS]++;
  }
}

void worker_main(Launch* L, Worker* w) {
  tl_worker = w;
  stack_t alt, old_alt;
  std::vector<char> alt_mem(1 << 16);
  alt.ss_sp = alt_mem.data();
  alt.ss_size = alt_mem.size();
  alt.ss_flags = 0;
  sigaltstack(&alt, &old_alt);
  w->stacks = take_stacks(L->stack_size);
  if (!w->stacks.mem) {
    set_error(L, EMU_ERR_LAUNCH, "could not map fiber stacks");
  } else {
    while (!L->failed.load(std::memory_order_relaxed)) {
      uint64_t t = L->next_group.fetch_add(1);
      if (t >= L->total_groups) break;
      run_group(w, t);
      w->counters[EMU_CNT_THREADGROUPS]++;
    }
    give_stacks(w->stacks);
  }
  alt.ss_flags = SS_DISABLE;
  sigaltstack(&old_alt, nullptr);
  tl_worker = nullptr;
}

}  // namespace

// ---------------------------------------------------------------------------
// Calls from kernels

extern "C" void emu_fiber_main(Fiber* f) {
  Worker* w = tl_worker;
  w->L->entry(w->bufs.data(), w->L->scalars, &f->attrs);
  f->state = DONE;
  fiber_yield(w, f);
  __builtin_trap();
}

extern "C" __attribute__((noinline)) void emu_rt_simd(const void* in, void* out,
                                                      emu_simd_fn fn) {
  Worker* w = tl_worker;
  Fiber* f = w->current;
  f->in = in;
  f->out = out;
  f->fn = fn;
  void** fp = static_cast<void**>(__builtin_frame_address(0));
  int n = 0;
  while (fp && n < kKeyDepth && reinterpret_cast<char*>(fp) >= f->stack_lo &&
         reinterpret_cast<char*>(fp) + 2 * sizeof(void*) <= f->stack_hi) {
    f->key[n++] = reinterpret_cast<uintptr_t>(fp[1]);
    void** next = static_cast<void**>(fp[0]);
    if (next <= fp) break;
    fp = next;
  }
  f->keyn = n;
  f->state = AT_SIMD;
  fiber_yield(w, f);
}

extern "C" void emu_rt_barrier(void) {
  Worker* w = tl_worker;
  Fiber* f = w->current;
  f->state = AT_BARRIER;
  fiber_yield(w, f);
}

extern "C" void emu_rt_oob(const emu_buf* b, const char* addr, uint32_t size,
                           int32_t is_write, int32_t misaligned) {
  Worker* w = tl_worker;
  long long off = static_cast<long long>(addr - b->base);
  long long span = static_cast<long long>(b->hi - b->lo);
  long long elems = b->elem_size > 0 ? span / b->elem_size : 0;
  const char* space = b->kind == EMU_BUF_THREADGROUP ? "threadgroup array"
                    : b->kind == EMU_BUF_CONSTANT ? "constant buffer" : "buffer";
  std::string idx = off % static_cast<long long>(size) == 0
      ? fmt("index %lld", off / static_cast<long long>(size))
      : fmt("byte offset %lld", off);
  // Threadgroup elements are plain references: reads and writes look alike.
  const char* how = b->kind == EMU_BUF_THREADGROUP ? "access" : is_write ? "write" : "read";
  std::string msg;
  if (misaligned) {
    msg = fmt("kernel '%s': misaligned %s of %u bytes at %s (byte offset %lld) "
              "of %s '%s' by %s; Metal needs %u-byte alignment here",
              w->L->name, how, size, idx.c_str(), off, space, b->name,
              where(w->current).c_str(), misaligned);
  } else {
    msg = fmt("kernel '%s': out-of-bounds %s of %s '%s' at %s (%u-byte "
              "elements, byte offset %lld) by %s; the %s holds %lld bytes = "
              "%lld elements of %d bytes",
              w->L->name, how, space, b->name, idx.c_str(), size, off,
              where(w->current).c_str(), space, span,
              elems, b->elem_size);
  }
  set_error(w->L, EMU_ERR_BOUNDS, msg);
  abandon(w);
}

extern "C" void emu_rt_fail(const char* message) {
  Worker* w = tl_worker;
  set_error(w->L, EMU_ERR_KERNEL,
            fmt("kernel '%s': %s in %s", w->L->name, message,
                where(w->current).c_str()));
  abandon(w);
}

extern "C" uint64_t emu_rt_tg_enter(uint64_t seen, uint64_t bytes,
                                    const char* name) {
  Worker* w = tl_worker;
  if (seen != w->tg_gen) {
    w->tg_bytes += bytes;
    if (w->tg_bytes > kThreadgroupMemory) {
      std::string m = fmt("threadgroup memory of %llu bytes (after '%s') "
                          "exceeds the 32 KB Metal allows",
                          (unsigned long long)w->tg_bytes, name);
      emu_rt_fail(m.c_str());
    }
  }
  return w->tg_gen;
}

extern "C" uint32_t emu_rt_lane(void) {
  return tl_worker->current->attrs.thread_index_in_simdgroup;
}

extern "C" int emu_abi_version(void) { return EMU_ABI_VERSION; }

extern "C" int emu_launch(emu_entry_fn entry, const char* kernel_name,
                          const uint32_t* grid, const uint32_t* threadgroup,
                          int32_t n_bufs, const emu_buf* bufs,
                          const void* const* scalars, int32_t n_workers,
                          int32_t mode, uint64_t stack_size,
                          uint64_t* read_out, uint64_t* written_out,
                          uint64_t* counters, char* error, uint64_t error_len) {
  g_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  Launch L;
  L.entry = entry;
  L.name = kernel_name;
  L.n_bufs = n_bufs;
  L.bufs = bufs;
  L.scalars = scalars;
  L.schedule = mode;
  L.stack_size = stack_size;
  L.total_groups = 1;
  for (int d = 0; d < 3; d++) {
    L.grid[d] = grid[d];
    L.tg[d] = std::min(threadgroup[d], grid[d]);  // as MLX clamps the group
    L.ntg[d] = L.tg[d] ? (grid[d] + L.tg[d] - 1) / L.tg[d] : 0;
    L.total_groups *= L.ntg[d];
  }
  for (int i = 0; i < EMU_CNT_N; i++) counters[i] = 0;
  for (int i = 0; i < n_bufs; i++) read_out[i] = written_out[i] = 0;
  if (L.total_groups == 0) return EMU_OK;

  int nw = static_cast<int>(std::max<uint64_t>(
      1, std::min<uint64_t>(std::max(n_workers, 1), L.total_groups)));
  std::vector<Worker> workers(nw);
  for (auto& w : workers) {
    w.L = &L;
    w.bufs.assign(bufs, bufs + n_bufs);
    w.fibers.resize(kMaxThreads);
  }
  install_signals();
  if (nw == 1) {
    worker_main(&L, &workers[0]);  // on the calling thread: no thread start-up
  } else {
    std::vector<std::thread> threads;
    for (int i = 0; i < nw; i++) threads.emplace_back(worker_main, &L, &workers[i]);
    for (auto& t : threads) t.join();
  }
  restore_signals();

  for (auto& w : workers) {
    for (int i = 0; i < n_bufs; i++) {
      read_out[i] += w.bufs[i].read;
      written_out[i] += w.bufs[i].written;
    }
    for (int i = 0; i < EMU_CNT_N; i++) counters[i] += w.counters[i];
  }
  if (L.error_code != EMU_OK && error && error_len) {
    snprintf(error, error_len, "%s", L.error.c_str());
  }
  return L.error_code;
}
