// The only file that touches Python: the module `ssdtrain._C`.
//
// NOTE [ Completions, the GIL and shutdown ]
// The engine's workers call a Python callback when a request ends, so they must take
// the GIL, and a thread holding the GIL must never wait for a worker: shutdown(), the
// destructor and every call that can block release the GIL first. The callback is
// stored as a raw owned reference and released by the worker under the GIL right
// after the call (or, if it never ran, by whichever thread destroys it, taking the GIL).
// If the last reference to the Engine is dropped inside a callback, the destructor
// runs on a worker thread; Engine::shutdown then detaches the workers instead of
// joining itself, and the GIL is kept (nothing blocks). While the interpreter is finalizing, a worker never takes the GIL
// (that would end the thread inside C++ code): the callback is skipped and leaked.
// In a forked child the workers do not exist: abandon() (called by ssdtrain.io.native
// from an os.register_at_fork handler, see ssdtrain/_fork.py) makes shutdown() and the
// destructor return at once; callbacks of requests queued before the fork are leaked.
//
// NOTE [ Submitting with the GIL held ]
// submit_write/submit_read keep the GIL: Engine::submit never blocks (it takes the
// queue mutex, which no thread ever holds while it waits for the GIL or for I/O, pushes
// and notifies). Releasing the GIL there cost the training thread the most: the moment
// it let go, a worker waiting to run a completion took the GIL, and the pack hook then
// waited for that whole Python callback before it could return (measured: ~200 us of
// a 256 KiB record's pack, a p99 of milliseconds; benchmarks/hook_cost.py).
//
// NOTE [ Completions without the GIL ]
// A callback per request costs the thread that launches kernels about 100 us a request
// on this project's VM (docs/results/launch_loop_cpu_2026-11-27.md): the worker takes
// the GIL to run it, and the training thread waits to take it back. A queued request
// (submit_write_queued/submit_read_queued) ends in C++ only: the worker appends
// (payload, errno, message, crc) to the engine's finished list under its mutex and
// notifies a condition variable; it never takes the GIL. The payload is any Python
// object the caller gives (ssdtrain.io.native: the request's future and the memory it
// owns); the submit call takes a reference to it before the request is queued, in the
// same C call, so a request is never in flight without it (an interrupt cannot fall
// between the two), and poll() hands that reference back: Python takes the list in one
// call (poll(), on whichever thread it chooses: ssdtrain.io.native polls on the thread
// that runs the hooks), and the payload, with whatever memory it holds, is let go of
// there, under the GIL. Waiting takes no GIL either (wait_any: until a request ends
// after a count the caller read, so that a completion another thread polled meanwhile
// is never waited for again). The mutex is held only to push, swap or count: no thread
// ever holds it while it waits for the GIL or for I/O. In a forked child (abandon())
// the mutex may have been copied locked: poll and wait_any then touch nothing and
// report nothing, and the payloads of the parent's requests are leaked.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "engine/crc32c.h"
#include "engine/engine.h"

namespace py = pybind11;

namespace {

bool interpreter_finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

class PyCompletion final : public ssdtrain::Completion {
 public:
  // Called with the GIL. With `want_crc`, the callback gets the CRC as a third argument.
  PyCompletion(py::function fn, bool want_crc) : fn_(fn.release().ptr()) {
    this->want_crc = want_crc;
  }
  ~PyCompletion() override {
    if (fn_ == nullptr || interpreter_finalizing()) return;
    const PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(fn_);
    PyGILState_Release(gil);
  }
  PyCompletion(const PyCompletion&) = delete;
  PyCompletion& operator=(const PyCompletion&) = delete;

  // Not noexcept: see Completion (pthread_exit while taking the GIL at finalization).
  void complete(int err, const std::string& message) override {
    if (fn_ == nullptr || interpreter_finalizing()) return;
    const PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* fn = std::exchange(fn_, nullptr);
    PyObject* code = PyLong_FromLong(err);
    PyObject* text = PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()),
                                          "replace");
    PyObject* result = nullptr;
    PyObject* crc = want_crc ? PyLong_FromUnsignedLong(this->crc) : nullptr;
    if (code != nullptr && text != nullptr && (crc != nullptr || !want_crc)) {
      result = PyObject_CallFunctionObjArgs(fn, code, text, crc, nullptr);
    }
    if (result == nullptr) {
      // A callback must not raise; report it like an exception in a __del__.
      PyErr_WriteUnraisable(fn);
    }
    Py_XDECREF(result);
    Py_XDECREF(crc);
    Py_XDECREF(text);
    Py_XDECREF(code);
    Py_DECREF(fn);
    PyGILState_Release(gil);
  }

 private:
  PyObject* fn_;  // owned
};

// NOTE [ Completions without the GIL ]: what queued requests end into.
struct Finished {
  PyObject* payload;  // owned: poll() hands it to Python
  int err;
  std::string message;
  std::uint32_t crc;
  bool has_crc;
};

struct FinishedList {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Finished> finished;  // ended, not polled yet
  std::uint64_t submitted = 0;     // requests queued so far
  std::uint64_t completed = 0;     // requests ended so far
  std::uint64_t ended = 0;         // requests ended so far, and wake()s (wait_any's count)
};

// Drops the references `finished` holds, taking the GIL (a list nobody will poll).
void release_payloads(std::vector<Finished>* finished) {
  if (finished->empty() || interpreter_finalizing()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  for (auto& f : *finished) Py_XDECREF(f.payload);
  finished->clear();
  PyGILState_Release(gil);
}

class QueuedCompletion final : public ssdtrain::Completion {
 public:
  // Steals `payload` (an owned reference).
  QueuedCompletion(std::shared_ptr<FinishedList> list, PyObject* payload, bool want_crc)
      : list_(std::move(list)), payload_(payload) {
    this->want_crc = want_crc;
  }
  // Never completed (the submission failed, or the engine was torn down without
  // running it): the reference is dropped here, under the GIL.
  ~QueuedCompletion() override {
    if (payload_ == nullptr || interpreter_finalizing()) return;
    const PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(payload_);
    PyGILState_Release(gil);
  }
  QueuedCompletion(const QueuedCompletion&) = delete;
  QueuedCompletion& operator=(const QueuedCompletion&) = delete;

  // Takes no GIL: the reference moves into the list under its mutex, then a notification.
  void complete(int err, const std::string& message) override {
    {
      std::lock_guard<std::mutex> lock(list_->mu);
      list_->finished.push_back(
          Finished{std::exchange(payload_, nullptr), err, message, this->crc, this->want_crc});
      ++list_->completed;
      ++list_->ended;
    }
    list_->cv.notify_all();
  }

 private:
  std::shared_ptr<FinishedList> list_;
  PyObject* payload_;  // owned until complete() hands it to the list
};

ssdtrain::Backend parse_backend(const std::string& name) {
  if (name == "auto") return ssdtrain::Backend::kAuto;
  if (name == "uring") return ssdtrain::Backend::kUring;
  if (name == "threads") return ssdtrain::Backend::kThreads;
  throw std::invalid_argument("backend must be 'auto', 'uring' or 'threads', got '" + name + "'");
}

class PyEngine {
 public:
  PyEngine(int threads, std::size_t chunk_bytes, const std::string& backend, unsigned watch_us)
      : engine_(std::make_unique<ssdtrain::Engine>(threads, chunk_bytes, parse_backend(backend),
                                                   watch_us)),
        list_(std::make_shared<FinishedList>()) {}

  // Runs with the GIL held (Python dropped the object), possibly on a worker thread,
  // inside a callback: there the engine only detaches its workers, which does not
  // block, and the GIL is kept (a worker retaking the GIL after the main thread
  // began finalizing would be ended by CPython).
  ~PyEngine() {
    const bool abandoned = engine_->abandoned();
    if (PyGILState_Check() && !engine_->on_worker_thread()) {
      PyThreadState* ts = PyEval_SaveThread();
      engine_.reset();
      PyEval_RestoreThread(ts);
    } else {
      engine_.reset();
    }
    if (!abandoned) {  // the workers are done: what nobody polled is let go of here
      std::vector<Finished> left;
      {
        std::lock_guard<std::mutex> lock(list_->mu);
        left.swap(list_->finished);
      }
      release_payloads(&left);
    }
  }

  std::string backend() const { return ssdtrain::Engine::backend_name(engine_->backend()); }
  std::uint64_t wakes() const { return engine_->wakes(); }

  // Keeps the GIL (NOTE [ Submitting with the GIL held ]).
  void submit(ssdtrain::Op op, int fd, bool direct, std::uint64_t offset, std::uintptr_t address,
              std::size_t nbytes, std::string path, py::function callback, bool crc) {
    auto done = std::make_unique<PyCompletion>(std::move(callback), crc);
    engine_->submit(op, fd, direct, offset, address, nbytes, std::move(path), std::move(done));
  }

  // Keeps the GIL (NOTE [ Submitting with the GIL held ]); the request ends into the
  // finished list (NOTE [ Completions without the GIL ]).
  // The reference to `payload` is taken before the request is queued; a submission that
  // throws drops it again (the completion's destructor).
  void submit_queued(ssdtrain::Op op, int fd, bool direct, std::uint64_t offset,
                     std::uintptr_t address, std::size_t nbytes, std::string path,
                     py::object payload, bool crc) {
    auto done = std::make_unique<QueuedCompletion>(list_, payload.release().ptr(), crc);
    engine_->submit(op, fd, direct, offset, address, nbytes, std::move(path), std::move(done));
    std::lock_guard<std::mutex> lock(list_->mu);
    ++list_->submitted;
  }

  // [(payload, errno, message, crc or None)] of the requests that ended since the last
  // poll, oldest first; with the GIL (the mutex is held for a swap only). With `sink`,
  // each tuple is appended to it instead (sink.append, a C call for a deque: no signal
  // handler runs between the list's swap and the last append, so an interrupt cannot
  // lose a payload that way) and the count is returned.
  py::object poll(py::object sink) {
    std::vector<Finished> got;
    if (!engine_->abandoned()) {
      std::lock_guard<std::mutex> lock(list_->mu);
      got.swap(list_->finished);
    }
    const bool to_sink = !sink.is_none();
    py::object append = to_sink ? sink.attr("append") : py::object();
    py::list out;
    std::size_t i = 0;
    try {
      for (; i < got.size(); ++i) {
        Finished& f = got[i];
        py::object crc = f.has_crc ? py::object(py::int_(f.crc)) : py::object(py::none());
        py::object message = py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(
            f.message.data(), static_cast<Py_ssize_t>(f.message.size()), "replace"));
        if (!message) throw py::error_already_set();
        py::object payload = py::reinterpret_steal<py::object>(std::exchange(f.payload, nullptr));
        py::tuple item = py::make_tuple(std::move(payload), f.err, std::move(message), crc);
        if (to_sink) {
          append(item);
        } else {
          out.append(item);
        }
      }
    } catch (...) {
      // What was not handed over goes back to the front of the list, in order, for the
      // next poll (a payload already moved into `item` went with it).
      std::lock_guard<std::mutex> lock(list_->mu);
      std::vector<Finished> rest;
      for (std::size_t j = i; j < got.size(); ++j) {
        if (got[j].payload != nullptr) rest.push_back(std::move(got[j]));
      }
      rest.insert(rest.end(), std::make_move_iterator(list_->finished.begin()),
                  std::make_move_iterator(list_->finished.end()));
      list_->finished.swap(rest);
      throw;
    }
    if (to_sink) return py::int_(got.size());
    return std::move(out);
  }

  // How many queued requests have ended so far (wait_any's `since`).
  std::uint64_t ended() {
    if (engine_->abandoned()) return 0;
    std::lock_guard<std::mutex> lock(list_->mu);
    return list_->ended;
  }

  // Waits without the GIL until more than `since` requests have ended, at most
  // `timeout` seconds (negative: no limit). Whether they had.
  bool wait_any(std::uint64_t since, double timeout) {
    if (engine_->abandoned()) return false;
    py::gil_scoped_release nogil;
    std::unique_lock<std::mutex> lock(list_->mu);
    auto more = [&] { return list_->ended > since; };
    if (timeout < 0) {
      list_->cv.wait(lock, more);
      return true;
    }
    return list_->cv.wait_for(lock, std::chrono::duration<double>(timeout), more);
  }

  // Counts as an ended request for wait_any, and wakes its waiters: for a future that
  // ends elsewhere (a device copy's waiter thread) but is waited for with the engine's.
  void wake() {
    if (engine_->abandoned()) return;
    {
      std::lock_guard<std::mutex> lock(list_->mu);
      ++list_->ended;
    }
    list_->cv.notify_all();
  }

  // Queued requests submitted and not ended yet.
  std::uint64_t in_flight() {
    if (engine_->abandoned()) return 0;
    std::lock_guard<std::mutex> lock(list_->mu);
    return list_->submitted - list_->completed;
  }

  void shutdown() {
    py::gil_scoped_release nogil;
    engine_->shutdown();
  }

  // Never blocks and takes no lock (see ssdtrain::Engine::abandon): keeps the GIL.
  void abandon() noexcept { engine_->abandon(); }
  bool abandoned() const noexcept { return engine_->abandoned(); }

 private:
  std::unique_ptr<ssdtrain::Engine> engine_;
  std::shared_ptr<FinishedList> list_;  // queued requests' completions
};

// Engine.submit_write and Engine.submit_read: the operation is bound in, the Python
// signature is the same.
template <ssdtrain::Op kOp>
void submit_op(PyEngine& self, int fd, bool direct, std::uint64_t offset, std::uintptr_t address,
               std::size_t nbytes, std::string path, py::function callback, bool crc) {
  self.submit(kOp, fd, direct, offset, address, nbytes, std::move(path), std::move(callback), crc);
}

template <ssdtrain::Op kOp>
void submit_queued_op(PyEngine& self, int fd, bool direct, std::uint64_t offset,
                      std::uintptr_t address, std::size_t nbytes, std::string path,
                      py::object payload, bool crc) {
  self.submit_queued(kOp, fd, direct, offset, address, nbytes, std::move(path),
                     std::move(payload), crc);
}

template <typename Class, typename Fn>
void def_submit_queued(Class& cls, const char* name, Fn fn, const char* doc) {
  cls.def(name, fn, py::arg("fd"), py::arg("direct"), py::arg("offset"), py::arg("address"),
          py::arg("nbytes"), py::arg("path"), py::arg("payload"), py::arg("crc") = false, doc);
}

template <typename Class, typename Fn>
void def_submit(Class& cls, const char* name, Fn fn, const char* doc) {
  cls.def(name, fn, py::arg("fd"), py::arg("direct"), py::arg("offset"), py::arg("address"),
          py::arg("nbytes"), py::arg("path"), py::arg("callback"), py::arg("crc") = false, doc);
}

// crc32c and crc32c_table: CRC32C of `nbytes` at `address`, without the GIL.
template <std::uint32_t (*kCrc)(const void*, std::size_t, std::uint32_t) noexcept>
std::uint32_t crc_at(std::uintptr_t address, std::size_t nbytes, std::uint32_t seed) {
  py::gil_scoped_release nogil;
  return kCrc(reinterpret_cast<const void*>(address), nbytes, seed);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ssdtrain's native I/O engine (torch-free); use it through ssdtrain.io.native.";

  // A system call that failed outside a request (a worker thread that could not start:
  // pthread_create's EAGAIN) becomes OSError(errno, message), so ssdtrain.io.native can
  // name the resource that ran out; pybind11 alone would make it a bare RuntimeError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      PyObject* args = Py_BuildValue("(is)", e.code().value(), e.what());
      if (args != nullptr) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
      }
    }
  });

  py::class_<PyEngine> engine(m, "Engine");
  engine
      .def(py::init<int, std::size_t, const std::string&, unsigned>(), py::arg("threads"),
           py::arg("chunk_bytes"), py::arg("backend") = "auto", py::arg("watch_us") = 0,
           "A pool of `threads` workers; requests split at address multiples of `chunk_bytes`.\n"
           "backend: 'auto' (io_uring where it works, else threads), 'uring' or 'threads'.\n"
           "watch_us: while requests keep coming, an idle worker looks at the queue every\n"
           "watch_us microseconds and a submit wakes nobody (0: every submit that finds a\n"
           "worker asleep wakes one).")
      .def("wakes", &PyEngine::wakes,
           "How many submits woke a worker (a futex call on the submitting thread).")
      .def_property_readonly("backend", &PyEngine::backend,
                             "The back end in use: 'uring' or 'threads'.");
  def_submit(engine, "submit_write", &submit_op<ssdtrain::Op::kWrite>,
             "Write `nbytes` at `address` to `fd` at `offset`; later, on a worker thread,\n"
             "callback(errno, message) with errno 0 on success; with crc=True,\n"
             "callback(errno, message, crc32c of the bytes), the CRC taken on the worker\n"
             "without the GIL. Keep the memory alive until then.");
  def_submit(engine, "submit_read", &submit_op<ssdtrain::Op::kRead>,
             "Read `nbytes` from `fd` at `offset` into `address`; callback as for submit_write\n"
             "(with crc=True, the CRC32C of the bytes read).");
  def_submit_queued(engine, "submit_write_queued", &submit_queued_op<ssdtrain::Op::kWrite>,
                    "As submit_write, but the request ends into the engine's finished list\n"
                    "(poll()), taking no GIL; a reference to `payload` is held from before the\n"
                    "request is queued until poll() hands it back (NOTE [ Completions without\n"
                    "the GIL ]).");
  def_submit_queued(engine, "submit_read_queued", &submit_queued_op<ssdtrain::Op::kRead>,
                    "As submit_read, but the request ends into the finished list (poll()).");
  engine
      .def("poll", &PyEngine::poll, py::arg("sink") = py::none(),
           "[(payload, errno, message, crc or None)] of the queued requests that ended\n"
           "since the last poll, oldest first; with `sink`, each is appended to it\n"
           "(sink.append) and their count is returned.")
      .def("ended", &PyEngine::ended, "How many queued requests have ended so far.")
      .def("wait_any", &PyEngine::wait_any, py::arg("since"), py::arg("timeout") = -1.0,
           "Wait, without the GIL, until more than `since` queued requests have ended\n"
           "(ended() counts them), at most `timeout` seconds (negative: no limit).\n"
           "Returns whether they had.")
      .def("wake", &PyEngine::wake,
           "Count one more ended request for wait_any and wake its waiters (a future that\n"
           "ends elsewhere but is waited for with the engine's).")
      .def("in_flight", &PyEngine::in_flight,
           "How many queued requests were submitted and have not ended.")
      .def("shutdown", &PyEngine::shutdown,
           "Finish every queued request (each callback runs), then stop the workers.")
      .def("abandon", &PyEngine::abandon,
           "In a forked child: forget the parent's workers without joining them. Later\n"
           "submits raise RuntimeError; shutdown() and destruction return at once; requests\n"
           "queued before the fork are never completed. Idempotent.")
      .def_property_readonly("abandoned", &PyEngine::abandoned,
                             "Whether abandon() was called.");

  m.def("crc32c", &crc_at<ssdtrain::crc32c>, py::arg("address"), py::arg("nbytes"),
        py::arg("seed") = 0,
        "CRC32C of `nbytes` at `address`; `seed` is a previous result to extend.");
  m.def("crc32c_table", &crc_at<ssdtrain::crc32c_table>, py::arg("address"), py::arg("nbytes"),
        py::arg("seed") = 0,
        "CRC32C by the portable table implementation (what crc32c uses without SSE4.2).");
  m.attr("crc32c_hardware") = ssdtrain::crc32c_hardware();
  m.def(
      "uring_probe",
      [] {
        std::string why;
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = ssdtrain::Engine::uring_available(&why);
        }
        return py::make_tuple(ok, why);
      },
      "(usable, reason): whether the io_uring back end works here, and why not.");
}
