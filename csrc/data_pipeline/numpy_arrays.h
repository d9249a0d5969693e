// numpy arrays at the pybind11 boundary of the data-pipeline modules: dtype and layout checks
// whose errors name the argument, and a zero-copy hand-over of a std::vector to numpy.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

namespace bertdist_numpy {

namespace py = pybind11;

// Whether `a` holds V values in native byte order. Not dtype identity (dtype.is): an array that
// went through pickling (Beam) has an equal but distinct dtype object.
template <typename V>
inline bool has_dtype(const py::array& a) {
  return py::isinstance<py::array_t<V>>(a);
}

inline std::string dtype_name(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

inline void check_array(const py::array& a, const char* what, py::ssize_t ndim) {
  if (a.ndim() != ndim)
    throw py::value_error(std::string(what) + ": expected a " + std::to_string(ndim) + "-D array, got " +
                          std::to_string(a.ndim()) + "-D");
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(what) + ": expected a C-contiguous array (np.ascontiguousarray)");
}

template <typename V>
inline void check_dtype(const py::array& a, const char* what) {
  if (!has_dtype<V>(a))
    throw py::value_error(std::string(what) + ": expected dtype " + py::str(py::dtype::of<V>()).cast<std::string>() +
                          ", got " + dtype_name(a));
}

template <typename V>
py::array to_numpy(std::vector<V>&& v) {
  if (v.empty()) return py::array_t<V>(0);
  auto* owned = new std::vector<V>(std::move(v));  // numpy owns the vector's buffer, no copy
  py::capsule free_it(owned, [](void* q) { delete static_cast<std::vector<V>*>(q); });
  return py::array_t<V>({static_cast<py::ssize_t>(owned->size())}, {sizeof(V)}, owned->data(), free_it);
}

}  // namespace bertdist_numpy
