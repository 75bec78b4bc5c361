// Python bindings for pipecore._C. The typed, documented API is in pipecore/ring.py and pipecore/ops.
// Every binding follows the rules of csrc/README.md: raise only with the GIL held (without_gil is the
// only way the GIL is released), check arguments before releasing it, translate errors locally.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "boundary.h"
#include "mailbox.h"
#include "ops_cpu.h"
#include "ring.h"
#include "stage_loop.h"
#include "thread_state.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipecore C++ extension: weight-version ring and fused CPU kernels";
  // Tensor conversion needs torch's Python bindings initialised; importing torch here makes
  // `import pipecore._C` work on its own (the loader finds libtorch through the rpath set in setup.py).
  py::module_::import("torch");

  // Errors, translated for this module only (rule 3). pipecore::Error carries the Python type to raise;
  // TimeoutError is the built-in type, not a pipecore subclass, so that callers catch it as usual.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pipecore::Error& e) {
      PyObject* type = PyExc_RuntimeError;
      switch (e.kind()) {
        case pipecore::ErrorKind::kValue: type = PyExc_ValueError; break;
        case pipecore::ErrorKind::kIndex: type = PyExc_IndexError; break;
        case pipecore::ErrorKind::kKey: type = PyExc_KeyError; break;
        case pipecore::ErrorKind::kTimeout: type = PyExc_TimeoutError; break;
        case pipecore::ErrorKind::kRuntime: break;
      }
      PyErr_SetString(type, e.what());
    }
  });
  // Registered after the translator above, so tried before it (pybind11 tries the newest first).
  py::register_local_exception<pipecore::Aborted>(m, "Aborted", PyExc_RuntimeError);

  py::class_<pipecore::WeightRing>(m, "WeightRing")
      .def(py::init<int64_t, int64_t, at::ScalarType, at::Device>(), py::arg("numel"), py::arg("num_slots"),
           py::arg("dtype"), py::arg("device"))
      .def("slot", &pipecore::WeightRing::slot, py::arg("i"))
      .def_property_readonly("buffer", &pipecore::WeightRing::buffer)
      .def_property_readonly("numel", &pipecore::WeightRing::numel)
      .def_property_readonly("num_slots", &pipecore::WeightRing::num_slots)
      .def_property_readonly("slot_stride", &pipecore::WeightRing::slot_stride)
      .def_property_readonly("nbytes", &pipecore::WeightRing::nbytes)
      .def_property_readonly("live_slot", &pipecore::WeightRing::live_slot)
      .def_property_readonly("live_version", &pipecore::WeightRing::live_version)
      .def("version_of", &pipecore::WeightRing::version_of, py::arg("i"))
      .def("pin_count", &pipecore::WeightRing::pin_count, py::arg("i"))
      .def("is_acquired", &pipecore::WeightRing::is_acquired, py::arg("i"))
      .def("state", &pipecore::WeightRing::state, py::arg("i"))
      .def("find", &pipecore::WeightRing::find, py::arg("version"))
      .def("acquire", &pipecore::WeightRing::acquire)
      .def("publish", &pipecore::WeightRing::publish, py::arg("i"), py::arg("version"))
      .def("advance", &pipecore::WeightRing::advance, py::arg("version"))
      .def("release", &pipecore::WeightRing::release, py::arg("i"))
      .def("rewind", &pipecore::WeightRing::rewind, py::arg("version"))
      .def("pin", &pipecore::WeightRing::pin, py::arg("i"))
      .def("unpin", &pipecore::WeightRing::unpin, py::arg("i"))
      .def("__repr__", &pipecore::WeightRing::repr);

  // Stage-thread synchronisation (mailbox.h). Waits release the GIL themselves, and only when
  // they have to block, so no call_guard here.

  py::class_<pipecore::Mailbox>(m, "Mailbox",
                                "Thread-safe map int -> object whose take() blocks (GIL released) until "
                                "the key is put.")
      .def(py::init<>())
      .def("put", &pipecore::Mailbox::put, py::arg("key"), py::arg("value"),
           "Store value under key and wake waiters; KeyError if key is already present.")
      .def("take", &pipecore::Mailbox::take, py::arg("key"), py::arg("timeout") = -1.0,
           "Remove and return the value under key, waiting (GIL released) until it is put. timeout in "
           "seconds, negative = forever; raises TimeoutError when it passes, Aborted after abort().")
      .def("contains", &pipecore::Mailbox::contains, py::arg("key"), "Whether key is present.")
      .def("__contains__", &pipecore::Mailbox::contains, py::arg("key"))
      .def("__len__", &pipecore::Mailbox::size, "Number of stored items.")
      .def("keys", &pipecore::Mailbox::keys, "Sorted list of the stored keys.")
      .def("abort", &pipecore::Mailbox::abort, py::arg("reason"),
           "Make every current and future take() raise Aborted(reason), until reset(). The first "
           "reason is kept.")
      .def("reset", &pipecore::Mailbox::reset, "Clear the aborted state; stored items stay.")
      .def("clear", &pipecore::Mailbox::clear, "Drop every stored item.")
      .def("put_tensors", &pipecore::Mailbox::put_tensors_py, py::arg("key"), py::arg("tensors"),
           "Store a list of tensors under key as a native message, one a StageLoop can take: detached aliases "
           "(the same memory, no autograd history). KeyError if key is already present. take() returns it as a "
           "list.");

  // The native stage loop (stage_loop.h). A program is a list of tuples: ("take", mailbox, key, [buffers]),
  // ("replay", graph) and ("post", mailbox, key, [buffers]); pipecore/runtime/native_loop.py builds them.
  py::class_<pipecore::Replayable, std::shared_ptr<pipecore::Replayable>>(m, "Replayable",
      "Something a StageLoop replays: a captured graph, or the CPU stand-in.")
      .def("__repr__", &pipecore::Replayable::describe);
  py::class_<pipecore::StandInGraph, pipecore::Replayable, std::shared_ptr<pipecore::StandInGraph>>(
      m, "StandInGraph", "CPU stand-in for a captured graph: outputs[i] = inputs[i] * scale + shift, in place.")
      .def(py::init<std::string, std::vector<at::Tensor>, std::vector<at::Tensor>, double, double, int64_t>(),
           py::arg("name"), py::arg("inputs"), py::arg("outputs"), py::arg("scale") = 1.0, py::arg("shift") = 0.0,
           py::arg("fail_at") = 0)
      .def_property_readonly("replays", &pipecore::StandInGraph::replays);
  py::class_<pipecore::StageLoop>(m, "StageLoop", "One stage's program of takes, replays and posts, run by a C++ "
                                                  "thread without the GIL.")
      .def(py::init<int64_t, std::vector<std::shared_ptr<pipecore::Replayable>>, std::vector<at::Tensor>,
                    const std::vector<py::object>&>(),
           py::arg("stage"), py::arg("graphs"), py::arg("buffers"), py::arg("mailboxes"))
      .def(
          "start",
          [](pipecore::StageLoop& loop, const py::list& program, double timeout) {
            std::vector<pipecore::Instruction> parsed;
            parsed.reserve(program.size());
            for (size_t i = 0; i < program.size(); ++i) {
              auto bad = [&](const std::string& why) {
                pipecore::raise(pipecore::ErrorKind::kValue,
                                "StageLoop.start: stage " + std::to_string(loop.stage()) + ", instruction " +
                                    std::to_string(i) + ": " + why + "; expected ('take', mailbox, key, [buffers]), "
                                    "('replay', graph) or ('post', mailbox, key, [buffers])");
              };
              py::handle item = program[i];
              if (!py::isinstance<py::tuple>(item)) bad("not a tuple");
              auto t = item.cast<py::tuple>();
              if (t.size() == 0 || !py::isinstance<py::str>(t[0])) bad("the first element is not an instruction name");
              const auto name = t[0].cast<std::string>();
              try {
                if (name == "replay" && t.size() == 2) {
                  parsed.push_back({pipecore::Instruction::Kind::kReplay, t[1].cast<int64_t>(), 0, {}});
                } else if ((name == "take" || name == "post") && t.size() == 4) {
                  parsed.push_back({name == "take" ? pipecore::Instruction::Kind::kTake
                                                   : pipecore::Instruction::Kind::kPost,
                                    t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<std::vector<int64_t>>()});
                } else {
                  bad("'" + name + "' with " + std::to_string(t.size() - 1) + " arguments");
                }
              } catch (const py::cast_error&) {
                bad("an argument of '" + name + "' is not an integer (or a list of them)");
              }
            }
            loop.start(std::move(parsed), timeout);
          },
          py::arg("program"), py::arg("timeout") = -1.0,
          "Check the program and start it on the loop's thread. timeout: seconds each take may wait (negative = "
          "forever).")
      .def("join", &pipecore::StageLoop::join, py::arg("timeout") = -1.0,
           "Wait (GIL released) for the program to end and raise its failure: Aborted, TimeoutError or "
           "RuntimeError naming the stage and instruction. TimeoutError if it is still running after timeout s.")
      .def("abort", &pipecore::StageLoop::abort, py::arg("reason"),
           "Abort the loop's mailboxes: the program stops at its next wait.")
      .def_property_readonly("running", &pipecore::StageLoop::running)
      .def_property_readonly("stage", &pipecore::StageLoop::stage)
      .def("completed", &pipecore::StageLoop::completed,
           "(instruction index, process-wide sequence number) for each instruction the latest program completed.");

  py::class_<pipecore::Progress>(m, "Progress", "One counter per stage, with waiting (GIL released).")
      .def(py::init<int64_t>(), py::arg("n"), "n counters at 0; ValueError if n < 1.")
      .def("set", &pipecore::Progress::set, py::arg("i"), py::arg("value"),
           "Set counter i and wake waiters; IndexError if i is out of range.")
      .def("get", &pipecore::Progress::get, py::arg("i"), "Value of counter i.")
      .def("wait_at_least", &pipecore::Progress::wait_at_least, py::arg("i"), py::arg("value"),
           py::arg("timeout") = -1.0,
           "Return once counter i >= value, waiting with the GIL released. timeout in seconds, negative "
           "= forever; raises TimeoutError when it passes, Aborted after abort().")
      .def("__len__", &pipecore::Progress::size, "Number of counters.")
      .def("abort", &pipecore::Progress::abort, py::arg("reason"),
           "Make every current and future wait_at_least() raise Aborted(reason), until reset(). The "
           "first reason is kept.")
      .def("reset", &pipecore::Progress::reset, "Clear the aborted state; counters keep their values.");

  // Kernels check their arguments with the GIL held, then release it around the computation only: they
  // touch only tensor memory, and a pipeline runs several stages' updates from different threads.
  m.def(
      "interpolate",
      [](const at::Tensor& out, const at::Tensor& live, const at::Tensor& stale, double alpha) {
        pipecore::cpu::check_interpolate(out, live, stale);
        pipecore::without_gil([&] { pipecore::cpu::interpolate(out, live, stale, alpha); });
      },
      py::arg("out"), py::arg("live"), py::arg("stale"), py::arg("alpha"));
  m.def(
      "predict",
      [](const at::Tensor& out, const at::Tensor& w, const at::Tensor& v, double scale) {
        pipecore::cpu::check_predict(out, w, v);
        pipecore::without_gil([&] { pipecore::cpu::predict(out, w, v, scale); });
      },
      py::arg("out"), py::arg("w"), py::arg("v"), py::arg("scale"));
  m.def(
      "sgd_step",
      [](const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad,
         const std::optional<at::Tensor>& momentum_buf, const std::optional<at::Tensor>& delta, double lr,
         double momentum, double dampening, double weight_decay, bool nesterov, bool first_step, double delta_decay) {
        pipecore::cpu::check_sgd_step(out, w, grad, momentum_buf, delta, momentum);
        pipecore::without_gil([&] {
          pipecore::cpu::sgd_step(out, w, grad, momentum_buf, delta, lr, momentum, dampening, weight_decay, nesterov,
                                  first_step, delta_decay);
        });
      },
      py::arg("out"), py::arg("w"), py::arg("grad"), py::arg("momentum_buf"), py::arg("delta"), py::arg("lr"),
      py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"), py::arg("first_step"),
      py::arg("delta_decay"));
  m.def(
      "adamw_step",
      [](const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
         const at::Tensor& exp_avg_sq, double wd_factor, double beta1, double beta2, double eps, double step_size,
         double bias_correction2_sqrt) {
        pipecore::cpu::check_adamw_step(out, w, grad, exp_avg, exp_avg_sq);
        pipecore::without_gil([&] {
          pipecore::cpu::adamw_step(out, w, grad, exp_avg, exp_avg_sq, wd_factor, beta1, beta2, eps, step_size,
                                    bias_correction2_sqrt);
        });
      },
      py::arg("out"), py::arg("w"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("wd_factor"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step_size"), py::arg("bias_correction2_sqrt"));
  m.def(
      "nadam_step",
      [](const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
         const at::Tensor& exp_avg_sq, double grad_decay, double wd_factor, double beta1, double beta2, double eps,
         double bias_correction2, double grad_step, double exp_avg_step) {
        pipecore::cpu::check_nadam_step(out, w, grad, exp_avg, exp_avg_sq);
        pipecore::without_gil([&] {
          pipecore::cpu::nadam_step(out, w, grad, exp_avg, exp_avg_sq, grad_decay, wd_factor, beta1, beta2, eps,
                                    bias_correction2, grad_step, exp_avg_step);
        });
      },
      py::arg("out"), py::arg("w"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad_decay"),
      py::arg("wd_factor"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("bias_correction2"),
      py::arg("grad_step"), py::arg("exp_avg_step"));
  m.def("_args_ok", &pipecore::cpu::args_ok, py::arg("tensors"), py::arg("n_weights"), py::arg("written_mask"),
        py::arg("out_index"), py::arg("alias_mask"));
  m.def("_streaming_threshold", &pipecore::cpu::streaming_threshold);
  m.def("_set_streaming_threshold", &pipecore::cpu::set_streaming_threshold, py::arg("bytes"));
  m.def("_streaming_store_bytes", &pipecore::cpu::streaming_store_bytes);
  m.def("_set_streaming_store_bytes", &pipecore::cpu::set_streaming_store_bytes, py::arg("bytes"));
  py::class_<pipecore::ThreadState::Guard>(m, "_ThreadStateGuard")
      .def("__enter__", [](pipecore::ThreadState::Guard& g) { return &g; }, py::return_value_policy::reference)
      .def("__exit__", [](pipecore::ThreadState::Guard& g, py::args) { g.exit(); });
  py::class_<pipecore::ThreadState>(m, "ThreadState",
                                    "The calling thread's torch thread-local state (grad mode, autocast, "
                                    "profiler, dispatch keys), captured to be entered on another thread.")
      .def(py::init<>())
      .def("enter", &pipecore::ThreadState::enter,
           "A context manager that makes the captured state current on the calling thread.");

  py::class_<pipecore::RecordingOff>(m, "RecordingOff",
                                     "A context manager: no profiler events (record-function callbacks) on the "
                                     "calling thread inside it.")
      .def(py::init<>())
      .def("__enter__", [](pipecore::RecordingOff& r) { r.enter(); return &r; }, py::return_value_policy::reference)
      .def("__exit__", [](pipecore::RecordingOff& r, py::args) { r.exit(); });

  m.attr("with_cuda") =
#ifdef PIPECORE_WITH_CUDA
      true;
#else
      false;
#endif
}
