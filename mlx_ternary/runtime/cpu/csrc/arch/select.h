// The one place a build's ISA is chosen (ggml-cpu's arch/ split is the model): the compiler's
// target (-march=native on x86-64, -mcpu=native or armv8.2-a+dotprod on arm64; build.py) picks
// one family here, and every kernel asks these macros and aliases, never the compiler's:
//
//   TK_X86      AVX2 + FMA + F16C: arch/x86.h
//   TK_NEON     arm64 NEON: arch/neon.h (SDOT where the CPU has dotprod)
//   neither     the portable definitions of arch/scalar.h
//
//   NativeOps   the ternary inner operations (arch/scalar.h's ScalarOps contract)
//   KqNative    llama.cpp tables' inner operations (KqScalar's contract)
//   native::    the kernels' other vector pieces (arch/scalar.h's portable:: contract)
//
// Inside arch/x86.h the instruction variants of the family (AVX-512F, VNNI, VL/BW, GFNI)
// follow the compiler's feature macros there, next to the code they change.
#pragma once

#include "scalar.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TK_X86 1
#include "x86.h"
namespace tk {
using NativeOps = Avx2Ops;
using KqNative = KqAvx2;
namespace native = x86;
}  // namespace tk
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define TK_NEON 1
#include "neon.h"
namespace tk {
using NativeOps = NeonOps;
using KqNative = KqScalar;  // arch/neon.h has no KqNeon (see there)
namespace native = neon;
}  // namespace tk
#else
namespace tk {
using NativeOps = ScalarOps;
using KqNative = KqScalar;
namespace native = portable;
}  // namespace tk
#endif
