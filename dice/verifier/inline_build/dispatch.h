// The per-program half of the generic binding (DESIGN.md §8.5; the other half: dispatch.cpp).
//
// torch's load_inline binds a program's `functions` with a PYBIND11_MODULE in main.cpp, which
// includes torch/extension.h: g++ then spends most of each program's host compile on templates
// of pybind11 and torch's Python layer. Here a program's host unit includes only torch/types.h
// and this header, and exports `__dice_entries`: per function its name, one type code per
// parameter and for the result, and a call through an array of `Value`s. The dispatcher module,
// compiled once per torch build, converts Python arguments with the very pybind11 casters
// torch's binding uses (dispatch.cpp) and calls the entry. A parameter or result type without a
// code fails to compile, and the build then falls back to torch's own load_inline.
#pragma once
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace dice_binding {

// One argument or result. Codes: T tensor, O optional tensor, i int, l 64-bit integer, f float,
// d double, b bool, K / L vector of int / 64-bit integers, F / D vector of float / double, V
// vector of tensors, s string; results also t tuple of tensors and v void.
struct Value {
  at::Tensor tensor;
  std::optional<at::Tensor> maybe_tensor;
  int64_t integer = 0;
  double real = 0;
  bool flag = false;
  std::vector<int64_t> integers;
  std::vector<double> reals;
  std::vector<at::Tensor> tensors;
  std::string text;
  char code = 'v';
};

struct Entry {
  const char* name;
  const char* params;       // one code per parameter
  char result;
  bool torch_errors;        // load_inline's with_pytorch_error_handling
  void (*call)(Value* args, Value& result);
};

template <class T> struct code_of { static constexpr char value = 0; };
template <> struct code_of<at::Tensor> { static constexpr char value = 'T'; };
template <> struct code_of<std::optional<at::Tensor>> { static constexpr char value = 'O'; };
template <> struct code_of<int> { static constexpr char value = 'i'; };
template <> struct code_of<long> { static constexpr char value = 'l'; };
template <> struct code_of<long long> { static constexpr char value = 'l'; };
template <> struct code_of<float> { static constexpr char value = 'f'; };
template <> struct code_of<double> { static constexpr char value = 'd'; };
template <> struct code_of<bool> { static constexpr char value = 'b'; };
template <> struct code_of<std::vector<int>> { static constexpr char value = 'K'; };
template <> struct code_of<std::vector<int64_t>> { static constexpr char value = 'L'; };
template <> struct code_of<std::vector<float>> { static constexpr char value = 'F'; };
template <> struct code_of<std::vector<double>> { static constexpr char value = 'D'; };
template <> struct code_of<std::vector<at::Tensor>> { static constexpr char value = 'V'; };
template <> struct code_of<std::string> { static constexpr char value = 's'; };

template <class T> using bare = std::remove_cv_t<std::remove_reference_t<T>>;
template <class T> constexpr char param_code = code_of<bare<T>>::value;

template <class T> struct is_tensor_tuple : std::false_type {};
template <class... A> struct is_tensor_tuple<std::tuple<A...>>
    : std::bool_constant<(std::is_same_v<bare<A>, at::Tensor> && ...)> {};

template <class R> constexpr char result_code() {
  if constexpr (std::is_void_v<R>) return 'v';
  else if constexpr (is_tensor_tuple<bare<R>>::value) return 't';
  else return std::string_view("TVilfdb").find(param_code<R>) != std::string_view::npos ? param_code<R> : 0;
}

// The argument as the parameter takes it: stored objects by reference, numbers converted back
// to the parameter's own type (the dispatcher already range-checked them as pybind11 does).
template <class P> decltype(auto) get(Value& v) {
  using D = bare<P>;
  if constexpr (std::is_same_v<D, at::Tensor>) return (v.tensor);
  else if constexpr (std::is_same_v<D, std::optional<at::Tensor>>) return (v.maybe_tensor);
  else if constexpr (std::is_same_v<D, std::vector<int64_t>>) return (v.integers);
  else if constexpr (std::is_same_v<D, std::vector<double>>) return (v.reals);
  else if constexpr (std::is_same_v<D, std::vector<int>>) return D(v.integers.begin(), v.integers.end());
  else if constexpr (std::is_same_v<D, std::vector<float>>) return D(v.reals.begin(), v.reals.end());
  else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) return (v.tensors);
  else if constexpr (std::is_same_v<D, std::string>) return (v.text);
  else if constexpr (std::is_same_v<D, bool>) return static_cast<D>(v.flag);
  else if constexpr (std::is_floating_point_v<D>) return static_cast<D>(v.real);
  else return static_cast<D>(v.integer);
}

template <class R> void put(Value& out, R&& r) {
  using D = bare<R>;
  out.code = result_code<R>();
  if constexpr (std::is_same_v<D, at::Tensor>) out.tensor = std::forward<R>(r);
  else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) out.tensors = std::forward<R>(r);
  else if constexpr (is_tensor_tuple<D>::value)
    std::apply([&](auto&... t) { out.tensors = {t...}; }, r);
  else if constexpr (std::is_same_v<D, bool>) out.flag = r;
  else if constexpr (std::is_floating_point_v<D>) out.real = r;
  else out.integer = r;
}

template <auto F, class R, class... A, std::size_t... I>
void invoke(Value* args, Value& out, R (*)(A...), std::index_sequence<I...>) {
  static_assert(((param_code<A> != 0) && ...),
                "dice: a parameter type the generic binding does not convert (the build falls back to torch's)");
  static_assert(result_code<R>() != 0,
                "dice: a result type the generic binding does not convert (the build falls back to torch's)");
  if constexpr (std::is_void_v<R>) {
    F(get<A>(args[I])...);
  } else {
    put(out, F(get<A>(args[I])...));
  }
}

template <auto F, class R, class... A> Entry entry(const char* name, bool torch_errors, R (*)(A...)) {
  static const char params[] = {param_code<A>..., '\0'};
  return {name, params, result_code<R>(), torch_errors,
          [](Value* args, Value& out) { invoke<F>(args, out, F, std::index_sequence_for<A...>{}); }};
}

}  // namespace dice_binding

// One entry per bound function: DICE_ENTRY(f, 1) for with_pytorch_error_handling=True.
#define DICE_ENTRY(f, torch_errors) dice_binding::entry<&f>(#f, torch_errors, &f)
