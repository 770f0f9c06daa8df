// The generic binding's Python side (DESIGN.md §8.5; the per-program side: dispatch.h), built
// once per torch build and toolchain into the build cache as the extension `dice_dispatch`.
//
// `load(path)` opens a program's library (RTLD_NOW | RTLD_LOCAL, as Python imports extensions)
// and returns [(name, callable)] for its `__dice_entries`. A call does what the pybind11 binding
// of torch's load_inline does for one overload: positional arguments only, each converted by
// pybind11's caster for the parameter's type with conversions allowed (a single overload skips
// pybind11's no-conversion pass), a TypeError when one does not convert, then the function under
// torch's HANDLE_TH_ERRORS when the program asked for torch's error handling, and the result
// cast back by pybind11.
#include <torch/extension.h>

#include <dlfcn.h>

#include <string>
#include <vector>

#include "dispatch.h"

namespace py = pybind11;
using dice_binding::Entry;
using dice_binding::Value;

namespace {

template <class T> T convert(py::handle obj, const Entry& e, size_t i) {
  py::detail::make_caster<T> caster;
  if (!caster.load(obj, true)) {
    throw py::type_error(std::string(e.name) + "(): incompatible function arguments: argument " +
                         std::to_string(i + 1) + " is " + std::string(py::str(py::type::handle_of(obj))));
  }
  return py::detail::cast_op<T>(std::move(caster));
}

Value argument(py::handle obj, const Entry& e, size_t i) {
  Value v;
  v.code = e.params[i];
  switch (v.code) {
    case 'T': v.tensor = convert<at::Tensor>(obj, e, i); break;
    case 'O': v.maybe_tensor = convert<std::optional<at::Tensor>>(obj, e, i); break;
    case 'i': v.integer = convert<int>(obj, e, i); break;
    case 'l': v.integer = convert<int64_t>(obj, e, i); break;
    case 'f': v.real = convert<float>(obj, e, i); break;
    case 'd': v.real = convert<double>(obj, e, i); break;
    case 'b': v.flag = convert<bool>(obj, e, i); break;
    case 'K': {
      auto values = convert<std::vector<int>>(obj, e, i);
      v.integers.assign(values.begin(), values.end());
      break;
    }
    case 'L': v.integers = convert<std::vector<int64_t>>(obj, e, i); break;
    case 'F': {
      auto values = convert<std::vector<float>>(obj, e, i);
      v.reals.assign(values.begin(), values.end());
      break;
    }
    case 'D': v.reals = convert<std::vector<double>>(obj, e, i); break;
    case 'V': v.tensors = convert<std::vector<at::Tensor>>(obj, e, i); break;
    case 's': v.text = convert<std::string>(obj, e, i); break;
    default: throw std::runtime_error(std::string(e.name) + ": unknown parameter code");
  }
  return v;
}

py::object result(const Value& v) {
  switch (v.code) {
    case 'v': return py::none();
    case 'T': return py::cast(v.tensor);
    case 'V': return py::cast(v.tensors);
    case 't': {
      py::tuple out(v.tensors.size());
      for (size_t i = 0; i < v.tensors.size(); ++i) out[i] = py::cast(v.tensors[i]);
      return out;
    }
    case 'i':
    case 'l': return py::int_(v.integer);
    case 'f':
    case 'd': return py::float_(v.real);
    case 'b': return py::bool_(v.flag);
    default: throw std::runtime_error("unknown result code");
  }
}

py::object call(const Entry& e, py::args args, py::kwargs kwargs) {
  size_t arity = std::char_traits<char>::length(e.params);
  if (kwargs.size() > 0 || args.size() != arity) {
    throw py::type_error(std::string(e.name) + "(): incompatible function arguments: takes " +
                         std::to_string(arity) + " positional arguments");
  }
  std::vector<Value> values;
  for (size_t i = 0; i < arity; ++i) values.push_back(argument(args[i], e, i));
  Value out;
  out.code = e.result;
  if (!e.torch_errors) {
    e.call(values.data(), out);
    return result(out);
  }
  HANDLE_TH_ERRORS
  e.call(values.data(), out);
  return result(out);
  END_HANDLE_TH_ERRORS_PYBIND
}

py::list load(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) throw py::import_error(dlerror());
  using Entries = const Entry* (*)(int*);
  auto entries = reinterpret_cast<Entries>(dlsym(handle, "__dice_entries"));
  if (entries == nullptr) throw py::import_error(path + " has no __dice_entries");
  int count = 0;
  const Entry* table = entries(&count);
  py::list out;
  for (int i = 0; i < count; ++i) {
    const Entry* e = &table[i];
    auto f = py::cpp_function([e](py::args args, py::kwargs kwargs) { return call(*e, args, kwargs); },
                              py::name(e->name));
    out.append(py::make_tuple(e->name, f));
  }
  return out;  // the library stays open: its functions live as long as the process
}

}  // namespace

PYBIND11_MODULE(dice_dispatch, m) {
  m.def("load", &load, "[(name, function)] of a library built with dispatch.h's entries");
}
