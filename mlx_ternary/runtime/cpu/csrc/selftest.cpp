// Standalone self-check of the kernels this compiler selects (no MLX, no Python): used to run
// the arm64 NEON path under qemu-user and to compile-check other ISAs. Exit status 0 = pass.
#include <cstdio>

#include "selfcheck.h"

int main() {
  std::string e = tk::selfcheck();
  if (e.empty()) e = tk::kq_selfcheck();
  std::printf("%s / %s: %s\n", tk::NativeOps::name, tk::dense_isa(), e.empty() ? "ok" : e.c_str());
  std::printf("exact digest %016llx\ngrouped digest %016llx\n",
              (unsigned long long)tk::int8_digests()[0], (unsigned long long)tk::int8_digests()[1]);
  return e.empty() ? 0 : 1;
}
