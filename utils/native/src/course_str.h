// Numbers and shapes in error messages, formatted with std::to_string and never through std::ostream.
// Why: on a CUDA machine image (torch 2.11.0+cu130, g++ 13.3, libstdc++ 6.0.33) an extension built by
// load_inline crashed with SIGSEGV as soon as it streamed an integer into a std::ostream, which is what
// TORCH_CHECK does with each argument of its message: a bad argument killed the process instead of raising.
// Strings, const char*, devices and dtypes stream safely; numbers go through these helpers.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <c10/util/ArrayRef.h>

namespace course {

template <typename T>
std::string num(T x) {
  static_assert(std::is_arithmetic_v<T>, "course::num formats numbers");
  if constexpr (std::is_integral_v<T>) {
    return std::to_string(static_cast<long long>(x));
  } else {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
    return buf;
  }
}

// [2, 4, 128, 64]: a shape or strides.
inline std::string shape(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

}  // namespace course
