// The interface between the emulator runtime (runtime.cpp) and the kernels it
// runs (metal_compat.h + a translated kernel). Plain C layout: Python fills it
// through ctypes.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define EMU_ABI_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

// One buffer a kernel can reach: an input, an output, or a _shape/_strides
// array. Each worker thread has its own copy, so the byte counters need no
// atomics; the runtime adds them up at the end of a launch.
typedef struct emu_buf {
  char* base;  // element 0, what the kernel's pointer points at
  char* lo;    // first readable byte (below base for negative strides)
  char* hi;    // one past the last readable byte
  uint64_t read;
  uint64_t written;
  const char* name;
  int32_t kind;       // EMU_BUF_*
  int32_t elem_size;  // bytes per element of the array, for messages
} emu_buf;

enum { EMU_BUF_DEVICE = 0, EMU_BUF_CONSTANT = 1, EMU_BUF_THREADGROUP = 2 };

// The Metal thread attributes of one thread.
typedef struct emu_attrs {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];           // actual size of this group
  uint32_t dispatch_threads_per_threadgroup[3];  // requested size
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
} emu_attrs;

typedef void (*emu_entry_fn)(emu_buf* bufs, const void* const* scalars,
                             const emu_attrs* attrs);

// A SIMD collective: every participating lane has put pointers to its input
// and output; `mask` has a bit per participating lane.
typedef struct emu_simd_group {
  uint32_t mask;
  uint32_t width;  // lanes in the whole simdgroup (32 unless partial)
  const void* in[32];
  void* out[32];
} emu_simd_group;

// Returns NULL, or a message that fails the launch.
typedef const char* (*emu_simd_fn)(const emu_simd_group* g);

// Kernel-side calls into the runtime.
void emu_rt_simd(const void* in, void* out, emu_simd_fn fn);
void emu_rt_barrier(void);
void emu_rt_oob(const emu_buf* b, const char* addr, uint32_t size,
                int32_t is_write, int32_t misaligned) __attribute__((noreturn));
void emu_rt_fail(const char* message) __attribute__((noreturn));
uint64_t emu_rt_tg_enter(uint64_t seen_generation, uint64_t bytes,
                         const char* name);
uint32_t emu_rt_lane(void);  // thread_index_in_simdgroup of the caller

enum {
  EMU_OK = 0,
  EMU_ERR_BOUNDS = 1,
  EMU_ERR_CRASH = 2,
  EMU_ERR_KERNEL = 3,
  EMU_ERR_LAUNCH = 4,
};

// Counters returned in `counters` by emu_launch.
enum {
  EMU_CNT_THREADGROUPS = 0,
  EMU_CNT_THREADS,
  EMU_CNT_SIMD_OPS,        // collective operations resolved (per simdgroup)
  EMU_CNT_DIVERGENT_OPS,   // of which some active lanes were elsewhere
  EMU_CNT_BARRIERS,        // threadgroup barriers released
  EMU_CNT_SWITCHES,        // fiber context switches
  EMU_CNT_N
};

// Runs a dispatch of grid threads in groups of threadgroup threads. mode:
// bit 0 runs the threads of a group last to first between barriers, bit 1
// fails on divergent SIMD-group operations. Returns EMU_OK or an EMU_ERR_*
// with a message in `error`; read_out/written_out get per-buffer byte counts.
int emu_launch(emu_entry_fn entry, const char* kernel_name,
               const uint32_t* grid, const uint32_t* threadgroup,
               int32_t n_bufs, const emu_buf* bufs, const void* const* scalars,
               int32_t n_workers, int32_t mode, uint64_t stack_size,
               uint64_t* read_out, uint64_t* written_out, uint64_t* counters,
               char* error, uint64_t error_len);

int emu_abi_version(void);

#ifdef __cplusplus
}
#endif
