// The decision-cache hit of DTensor dispatch, in C++: stages (a) key and (b) lookup of
// dtensor_ops/README.md "How an op runs", plus the local call and the wrapper of a simple decision.
//
// It mirrors the flat fast path of shardwise/dtensor_ops/_dispatch.py exactly: positional DTensors
// (replaced by their spec), values of the self-keyed types (ints, strings, None, dtypes, ...), floats
// and complex numbers ((type, value), or the type alone where the op's rule says values cannot change
// the decision), bools ((bool, value)) and lists of ints ((list, item, ...)).  Anything else (kwargs,
// plain tensors, lists of other things, SymInts, ops whose float rule is not known yet, a miss, a
// decision that is not simple) returns None and the Python path runs, which stays the reference.
//
// Only the CPython API and pybind11 are used: no libtorch headers, so the module builds against the
// interpreter alone and every torch object is handled as a Python object.

#include <pybind11/pybind11.h>

#include <vector>

namespace py = pybind11;

namespace {

struct Config {
  PyObject* dtensor_type = nullptr;      // shardwise.dtensor_ops.DTensor
  // The module holding DECISIONS, read at every call: the threaded test world swaps the attribute
  // for a per-thread mapping (then the Python path runs), so a held dict could be another rank's.
  PyObject* decision_module = nullptr;
  PyObject* self_keyed_types = nullptr;  // _decision_cache.SELF_KEYED_TYPES (frozenset of types)
  PyObject* float_values_matter = nullptr;  // _decision_cache._FLOAT_VALUES_MATTER (dict op -> bool)
  PyObject* make_wrapper = nullptr;      // torch.Tensor._make_wrapper_subclass
  PyObject* overload_type = nullptr;     // torch._ops.OpOverload: its _op is called directly
  bool configured = false;
};

Config config;

// Simple decisions served here since the last reset_hit_count(): the C++ share of the hits that
// debug._get_fast_path_sharding_prop_cache_stats() reports (the Python path counts its own).  A plain
// integer bumped under the GIL: free next to the call it counts.
unsigned long long simple_hits = 0;

// Interned attribute names, made once.
PyObject* name_decisions = nullptr;
PyObject* name_local_tensor = nullptr;
PyObject* name_spec = nullptr;
PyObject* name_simple = nullptr;
PyObject* name_call = nullptr;
PyObject* name_output_shape = nullptr;
PyObject* name_output_stride = nullptr;
PyObject* name_output_spec = nullptr;
PyObject* name_dtype = nullptr;
PyObject* name_layout = nullptr;
PyObject* name_device = nullptr;
PyObject* name_op = nullptr;

void intern_names() {
  name_decisions = PyUnicode_InternFromString("DECISIONS");
  name_local_tensor = PyUnicode_InternFromString("_local_tensor");
  name_spec = PyUnicode_InternFromString("_spec");
  name_simple = PyUnicode_InternFromString("simple");
  name_call = PyUnicode_InternFromString("call");
  name_output_shape = PyUnicode_InternFromString("output_shape");
  name_output_stride = PyUnicode_InternFromString("output_stride");
  name_output_spec = PyUnicode_InternFromString("output_spec");
  name_dtype = PyUnicode_InternFromString("dtype");
  name_layout = PyUnicode_InternFromString("layout");
  name_device = PyUnicode_InternFromString("device");
  name_op = PyUnicode_InternFromString("_op");
}

// Owns a reference; releases it when it goes out of scope.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o = nullptr) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
};

// 1: keep float values, 0: key floats by type, -1: not known yet (the Python path learns it).
int float_values_matter(PyObject* op) {
  PyObject* known = PyDict_GetItemWithError(config.float_values_matter, op);  // borrowed
  if (known == nullptr) {
    PyErr_Clear();
    return -1;
  }
  return PyObject_IsTrue(known);
}

// Builds the key of op(*args) and, when locals is given, this rank's positional arguments for the
// local op.  Returns a new reference, or nullptr (no Python error set) when the call is not one the
// flat fast path keys.
PyObject* build_key(PyObject* op, PyObject* args, std::vector<PyObject*>* locals) {
  const Py_ssize_t count = PyTuple_GET_SIZE(args);
  Ref key(PyTuple_New(count + 1));
  if (key.p == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  Py_INCREF(op);
  PyTuple_SET_ITEM(key.p, 0, op);
  int keep_floats = -2;  // looked up on the first float
  for (Py_ssize_t index = 0; index < count; ++index) {
    PyObject* arg = PyTuple_GET_ITEM(args, index);  // borrowed
    PyTypeObject* arg_type = Py_TYPE(arg);
    PyObject* part = nullptr;  // new reference
    PyObject* local = arg;     // borrowed
    if (reinterpret_cast<PyObject*>(arg_type) == config.dtensor_type) {
      part = PyObject_GetAttr(arg, name_spec);
      local = PyObject_GetAttr(arg, name_local_tensor);
      if (part == nullptr || local == nullptr) {
        Py_XDECREF(part);
        Py_XDECREF(local);
        PyErr_Clear();
        return nullptr;
      }
      Py_DECREF(local);  // the DTensor keeps it alive for the call
    } else if (arg_type == &PyBool_Type) {
      part = PyTuple_Pack(2, reinterpret_cast<PyObject*>(&PyBool_Type), arg);
    } else if (arg_type == &PyFloat_Type || arg_type == &PyComplex_Type) {
      if (keep_floats == -2) keep_floats = float_values_matter(op);
      if (keep_floats < 0) return nullptr;
      if (keep_floats) {
        part = PyTuple_Pack(2, reinterpret_cast<PyObject*>(arg_type), arg);
      } else {
        part = reinterpret_cast<PyObject*>(arg_type);
        Py_INCREF(part);
      }
    } else if (arg_type == &PyList_Type) {
      const Py_ssize_t items = PyList_GET_SIZE(arg);
      part = PyTuple_New(items + 1);
      if (part == nullptr) {
        PyErr_Clear();
        return nullptr;
      }
      Py_INCREF(reinterpret_cast<PyObject*>(&PyList_Type));
      PyTuple_SET_ITEM(part, 0, reinterpret_cast<PyObject*>(&PyList_Type));
      for (Py_ssize_t item = 0; item < items; ++item) {
        PyObject* value = PyList_GET_ITEM(arg, item);
        if (Py_TYPE(value) != &PyLong_Type) {  // exactly int (not bool, not SymInt)
          Py_DECREF(part);
          return nullptr;
        }
        Py_INCREF(value);
        PyTuple_SET_ITEM(part, item + 1, value);
      }
    } else {
      const int self_keyed = PySet_Contains(config.self_keyed_types, reinterpret_cast<PyObject*>(arg_type));
      if (self_keyed != 1) {
        if (self_keyed < 0) PyErr_Clear();
        return nullptr;
      }
      part = arg;
      Py_INCREF(part);
    }
    if (part == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    PyTuple_SET_ITEM(key.p, index + 1, part);
    if (locals != nullptr) locals->push_back(local);
  }
  return key.release();
}

py::object call_key(py::handle op, py::tuple args) {
  if (!config.configured) throw std::runtime_error("shardwise _fastpath_ext: configure() was not called");
  PyObject* key = build_key(op.ptr(), args.ptr(), nullptr);
  if (key == nullptr) return py::none();
  return py::reinterpret_steal<py::object>(key);
}

// The whole cache hit of a simple decision: the wrapped DTensor, or None for the Python path.
py::object try_hit(py::handle op, py::tuple args) {
  if (!config.configured) return py::none();
  std::vector<PyObject*> locals;
  locals.reserve(PyTuple_GET_SIZE(args.ptr()));
  Ref key(build_key(op.ptr(), args.ptr(), &locals));
  if (key.p == nullptr) return py::none();
  Ref decisions(PyObject_GetAttr(config.decision_module, name_decisions));
  if (decisions.p == nullptr || !PyDict_CheckExact(decisions.p)) {
    PyErr_Clear();
    return py::none();
  }
  PyObject* decision = PyDict_GetItemWithError(decisions.p, key.p);  // borrowed
  if (decision == nullptr) {
    PyErr_Clear();  // a miss, or an unhashable key (symbolic sizes): the Python path decides
    return py::none();
  }
  Ref keep_decision(decision);
  Py_INCREF(decision);
  Ref simple(PyObject_GetAttr(decision, name_simple));
  if (simple.p != Py_True) {
    PyErr_Clear();
    return py::none();
  }
  Ref call(PyObject_GetAttr(decision, name_call));
  if (call.p != nullptr && reinterpret_cast<PyObject*>(Py_TYPE(call.p)) == config.overload_type) {
    // OpOverload.__call__ only forwards to its C++ _op: call that and skip a Python frame.
    PyObject* op_function = PyObject_GetAttr(call.p, name_op);
    if (op_function == nullptr) throw py::error_already_set();
    Py_DECREF(call.p);
    call.p = op_function;
  }
  Ref local_args(PyTuple_New(static_cast<Py_ssize_t>(locals.size())));
  if (call.p == nullptr || local_args.p == nullptr) throw py::error_already_set();
  for (size_t index = 0; index < locals.size(); ++index) {
    Py_INCREF(locals[index]);
    PyTuple_SET_ITEM(local_args.p, static_cast<Py_ssize_t>(index), locals[index]);
  }
  // From here on errors are the op's own: they propagate as they would from the Python path.
  Ref result(PyObject_Call(call.p, local_args.p, nullptr));
  if (result.p == nullptr) throw py::error_already_set();
  Ref shape(PyObject_GetAttr(decision, name_output_shape));
  Ref stride(PyObject_GetAttr(decision, name_output_stride));
  Ref spec(PyObject_GetAttr(decision, name_output_spec));
  Ref dtype(PyObject_GetAttr(result.p, name_dtype));
  Ref layout(PyObject_GetAttr(result.p, name_layout));
  Ref device(PyObject_GetAttr(result.p, name_device));
  if (!shape.p || !stride.p || !spec.p || !dtype.p || !layout.p || !device.p) throw py::error_already_set();
  PyObject* wrapper_args[] = {config.dtensor_type, shape.p, stride.p, Py_None, Py_None, dtype.p, layout.p, device.p};
  Ref wrapped(PyObject_Vectorcall(config.make_wrapper, wrapper_args, 8, nullptr));
  if (wrapped.p == nullptr) throw py::error_already_set();
  if (PyObject_SetAttr(wrapped.p, name_local_tensor, result.p) < 0 || PyObject_SetAttr(wrapped.p, name_spec, spec.p) < 0) {
    throw py::error_already_set();
  }
  ++simple_hits;
  return py::reinterpret_steal<py::object>(wrapped.release());
}

void configure(py::handle dtensor_type, py::module_ decision_module, py::handle self_keyed_types,
               py::dict float_values_matter, py::handle make_wrapper, py::handle overload_type) {
  if (!PyAnySet_Check(self_keyed_types.ptr())) throw py::type_error("self_keyed_types must be a (frozen)set of types");
  PyObject* fresh[] = {dtensor_type.ptr(), decision_module.ptr(), self_keyed_types.ptr(), float_values_matter.ptr(),
                       make_wrapper.ptr(), overload_type.ptr()};
  for (PyObject* object : fresh) Py_INCREF(object);
  PyObject* old[] = {config.dtensor_type, config.decision_module, config.self_keyed_types, config.float_values_matter,
                     config.make_wrapper, config.overload_type};
  config.dtensor_type = fresh[0];
  config.decision_module = fresh[1];
  config.self_keyed_types = fresh[2];
  config.float_values_matter = fresh[3];
  config.make_wrapper = fresh[4];
  config.overload_type = fresh[5];
  config.configured = true;
  for (PyObject* object : old) Py_XDECREF(object);
}

}  // namespace

PYBIND11_MODULE(_fastpath_ext, module) {
  module.doc() = "shardwise DTensor dispatch: the decision-cache hit (key, lookup, local call, wrapper) in C++";
  // Bumped whenever configure()'s arguments or the key's rules change; _fastpath.py ignores a build
  // of another version (a stale .so falls back to Python rather than breaking the import).
  module.attr("INTERFACE_VERSION") = 3;
  intern_names();
  module.def("configure", &configure, py::arg("dtensor_type"), py::arg("decision_module"), py::arg("self_keyed_types"),
             py::arg("float_values_matter"), py::arg("make_wrapper"), py::arg("overload_type"),
             "Give the module the DTensor class, the one decision cache and the key builder's tables.");
  module.def("call_key", &call_key, py::arg("op"), py::arg("args"),
             "The decision-cache key of op(*args) on the flat fast path, or None where the Python path keys it.");
  module.def("try_hit", &try_hit, py::arg("op"), py::arg("args"),
             "The wrapped result of a cache hit of a simple decision, or None (the Python path runs).");
  module.def("hit_count", []() { return simple_hits; },
             "How many calls try_hit served (cache hits of simple decisions) since the last reset_hit_count().");
  module.def("reset_hit_count", []() { simple_hits = 0; }, "Start counting try_hit's hits from zero.");
}
