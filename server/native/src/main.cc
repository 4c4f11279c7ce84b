// batchgate-frontend: the native front end of `batchgate serve --frontend native`.
//
// Started by the supervisor (server/supervisor/supervisor.py) with the handover, a serialized
// FrontendHandover (protos/handover.proto), on stdin. Reports `frontend_ready` on stderr once the executor has
// welcomed it; drains and exits 0 on SIGTERM or SIGINT; exits 1, with one log line saying why,
// when it cannot start.
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <absl/synchronization/mutex.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>
#include <thread>

#include "frontend.h"
#include "handover.h"
#include "log.h"
#include "rules.h"

namespace {

// SIGTERM and SIGINT, read from a signalfd on one thread: every thread (gRPC's included, which
// inherit the mask) keeps them blocked, so no handler ever runs inside library code.
class SignalThread {
 public:
  bool Start(const sigset_t& signals, batchgate::Frontend& frontend) {
    signal_fd_ = signalfd(-1, &signals, SFD_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_CLOEXEC);
    if (signal_fd_ < 0 || wake_fd_ < 0) return false;
    thread_ = std::thread([this, &frontend] { Run(frontend); });
    return true;
  }

  ~SignalThread() {
    if (thread_.joinable()) {
      const uint64_t one = 1;
      [[maybe_unused]] const ssize_t n = write(wake_fd_, &one, sizeof one);
      thread_.join();
    }
    if (signal_fd_ >= 0) close(signal_fd_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

 private:
  void Run(batchgate::Frontend& frontend) {
    pthread_setname_np(pthread_self(), "bg-signals");
    while (true) {
      pollfd fds[2] = {{signal_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      if (poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[1].revents) return;
      signalfd_siginfo info{};
      if (read(signal_fd_, &info, sizeof info) == sizeof info) {
        // A second signal while draining changes nothing (server/frontend.py).
        frontend.RequestStop();
      }
    }
  }

  int signal_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
};

}  // namespace

int main() {
  // gRPC locks with Abseil's Mutex, whose lock-order (deadlock) detection is on unless Abseil was
  // built with NDEBUG, as Debian's is not: it keeps a graph of every lock order it sees, about
  // 5 % of this process's CPU under load (perf). A lock-order bug of gRPC's is not ours to find
  // in production.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Before any thread exists, so that every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A peer that goes away must not kill the process: writes to it fail with EPIPE instead.
  signal(SIGPIPE, SIG_IGN);
  batchgate::CaptureLibraryLogs();

  const std::string serialized((std::istreambuf_iterator<char>(std::cin)),
                               std::istreambuf_iterator<char>());
  batchgate::Handover handover;
  std::string error;
  if (!batchgate::ParseHandover(serialized, &handover, &error)) {
    batchgate::Log(batchgate::LogLevel::kError, "frontend_start_failed", {batchgate::LogField("error", error)});
    return 1;
  }
  batchgate::SetLogSlot(handover.slot);
  batchgate::SetLogLevel(handover.log_level);
  // The whole process is request path: under SCHED_BATCH its threads (all started after this,
  // and inheriting it) do not preempt the executor's model threads when they wake. Only from
  // SCHED_OTHER: a policy someone chose for the process (chrt) stays.
  if (handover.batch_scheduling && sched_getscheduler(0) == SCHED_OTHER) {
    const sched_param normal{};
    if (sched_setscheduler(0, SCHED_BATCH, &normal) != 0) {
      batchgate::Log(batchgate::LogLevel::kWarning, "request_scheduling_not_applied",
                     {batchgate::LogField("policy", std::string("batch")),
                      batchgate::LogField("reason", std::string("sched_setscheduler: ") + std::strerror(errno)),
                      batchgate::LogField("effect", std::string(batchgate::rules::kSchedulingNotAppliedEffect))});
    }
  }

  batchgate::Frontend frontend(std::move(handover));
  SignalThread signal_thread;
  if (!signal_thread.Start(signals, frontend)) {
    batchgate::Log(batchgate::LogLevel::kError, "frontend_start_failed",
                   {batchgate::LogField("error", std::string("signalfd: ") + std::strerror(errno))});
    return 1;
  }
  return frontend.Run();
}
