// Unit tests: the executor link against a fake executor on a real abstract socket: what it
// writes and when, what it reads and posts, and what a lost connection keeps.
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <random>
#include <string>
#include <vector>

#include "auth.h"
#include "codec.h"
#include "executor_link.h"
#include "frame_reader.h"
#include "frontend.h"
#include "handover.h"
#include "protos/handover.pb.h"
#include "input_region.h"
#include "metrics.h"
#include "model_table.h"
#include "text.h"
#include "wire_columns.h"
#include "wire_scan.h"
#include "check.h"

namespace {

using batchgate::DataType;
using batchgate::ModelState;

// -- the executor link's writing --------------------------------------------------------------

// The executor's end of a link, played by the test: one abstract socket, frames read and written
// whole.
class FakeExecutor {
 public:
  explicit FakeExecutor(const std::string& name) {
    listener_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path + 1, name.data(), name.size());
    const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    CHECK(bind(listener_, reinterpret_cast<sockaddr*>(&address), length) == 0);
    CHECK(listen(listener_, 1) == 0);
  }
  ~FakeExecutor() {
    if (fd_ >= 0) close(fd_);
    close(listener_);
  }
  void Accept() {
    fd_ = accept(listener_, nullptr, nullptr);
    CHECK(fd_ >= 0);
    // A frame that never comes fails the test instead of hanging it.
    const timeval limit{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  }
  bool Read(batchgate::wire::ToExecutor* frame) {
    unsigned char header[4];
    if (!ReadAll(reinterpret_cast<char*>(header), 4)) return false;
    const uint32_t size = header[0] | header[1] << 8 | header[2] << 16 | uint32_t{header[3]} << 24;
    largest_frame = std::max<uint64_t>(largest_frame, size);
    std::string body(size, '\0');
    return ReadAll(body.data(), size) && frame->ParseFromString(body);
  }
  // The largest frame body read so far.
  uint64_t largest_frame = 0;
  // Drops the accepted connection (the link sees its executor go).
  void CloseConnection() {
    close(fd_);
    fd_ = -1;
  }
  // Whether bytes wait to be read, without reading them.
  bool Pending() {
    char byte;
    return recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
  }
  void Write(const batchgate::wire::ToFrontend& frame) { WriteBytes(FrameBytes(frame)); }
  // Several frames in one send: the link's reader finds them all in one read.
  void WriteTogether(const std::vector<batchgate::wire::ToFrontend>& frames) {
    std::string all;
    for (const auto& frame : frames) all += FrameBytes(frame);
    WriteBytes(all);
  }
  void WriteBytes(const std::string& bytes) {
    CHECK(send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()));
  }
  static std::string FrameBytes(const batchgate::wire::ToFrontend& frame) {
    std::string bytes = frame.SerializeAsString();
    const uint32_t size = static_cast<uint32_t>(bytes.size());
    std::string all(4, '\0');
    for (int i = 0; i < 4; ++i) all[i] = static_cast<char>((size >> (8 * i)) & 0xFF);
    return all + bytes;
  }

 private:
  bool ReadAll(char* data, size_t size) {
    while (size > 0) {
      const ssize_t n = recv(fd_, data, size, 0);
      if (n <= 0) return false;
      data += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  }
  int listener_ = -1;
  int fd_ = -1;
};

class LinkEvents final : public batchgate::LinkObserver {
 public:
  void OnConnectionChange(bool connected, size_t /*models*/) override {
    std::lock_guard<std::mutex> lock(mu_);
    connected_ = connected;
    changed_.notify_all();
  }
  void OnModelChange(const std::string& /*name*/, bool /*serving*/) override {}
  bool WaitConnected() {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, std::chrono::seconds(10), [&] { return connected_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  bool connected_ = false;
};

// Counts the answers the link hands over (when it closes, everything in flight is answered).
class CountingTarget final : public batchgate::AnswerTarget, public batchgate::AnswerMailbox {
 public:
  batchgate::AnswerMailbox& mailbox() override { return *this; }
  void Post(std::vector<batchgate::PostedAnswer>& answers) override {
    for (const auto& posted : answers) {
      if (posted.answer.status.error_code() == grpc::StatusCode::UNAVAILABLE) ++unavailable;
    }
    answers.clear();
  }
  void OnExecutorAnswer(batchgate::ExecutorAnswer /*answer*/) override {}
  std::atomic<int> unavailable{0};
};

// Accepts the link's connection, reads its Hello and welcomes it.
void Welcome(FakeExecutor& executor, LinkEvents& events) {
  executor.Accept();
  batchgate::wire::ToExecutor frame;
  CHECK(executor.Read(&frame) && frame.has_hello());
  batchgate::wire::ToFrontend welcome;
  welcome.set_welcome(true);
  executor.Write(welcome);
  CHECK(events.WaitConnected());
}

// A link connected to a FakeExecutor of its own and welcomed; `target` counts its answers.
struct ConnectedLink {
  explicit ConnectedLink(const std::string& name)
      : executor(name), region(0, 1 << 20), link(name, 0, region, models, events) {
    link.Start();
    Welcome(executor, events);
  }
  // Submits `infer` for `target`, which must be accepted: its rid.
  uint64_t Submit(batchgate::wire::Infer infer = {}, bool groupable = false) {
    uint64_t rid = 0;
    grpc::Status refusal;
    CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(std::move(infer)), {}, 1,
                           &target, &rid, &refusal, groupable));
    return rid;
  }
  FakeExecutor executor;
  batchgate::InputRegion region;
  batchgate::ModelTable models;
  LinkEvents events;
  CountingTarget target;
  batchgate::ExecutorLink link;  // last: it goes first
};

void TestLinkWritesEveryEntryInOrder() {
  // Several threads submit while the executor reads nothing: far more than a socket holds (the
  // link asks for 4 MiB buffers), so a submitter's write stops part-way and the writer thread
  // finishes it, while later entries wait. Submitting never blocks. Every Infer must reach the
  // executor once, in rid order (rids are taken in the order entries join the frame), each
  // cancel after its Infer.
  ConnectedLink connected("batchgate-unit-" + std::to_string(getpid()));
  FakeExecutor& executor = connected.executor;
  CountingTarget& target = connected.target;
  batchgate::ExecutorLink& link = connected.link;
  batchgate::wire::ToExecutor frame;

  constexpr int kThreads = 3;
  constexpr int kPerThread = 40;
  const std::string id(128 << 10, 'x');  // 15 MiB in all
  std::atomic<int> refused{0};
  std::vector<std::thread> submitters;
  for (int t = 0; t < kThreads; ++t) {
    submitters.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        auto infer = std::make_unique<batchgate::wire::Infer>();
        infer->set_id(id);
        uint64_t rid = 0;
        grpc::Status refusal;
        if (!link.SubmitInfer(std::move(infer), {}, 1, &target, &rid, &refusal)) {
          ++refused;
          continue;
        }
        if (rid % 7 == 0) link.Cancel(rid);
      }
    });
  }
  for (auto& thread : submitters) thread.join();
  uint64_t last = 0;
  int infers = 0;
  bool ordered = true;
  std::map<uint64_t, bool> cancel_after_infer;  // rid -> its Infer came first
  while (infers < kThreads * kPerThread && executor.Read(&frame)) {
    for (const auto& infer : frame.infer()) {
      ordered = ordered && infer.rid() == last + 1 && infer.id() == id;
      last = infer.rid();
      ++infers;
    }
    for (const uint64_t rid : frame.cancel()) cancel_after_infer[rid] = rid <= last;
  }
  CHECK_EQ(refused.load(), 0);
  CHECK_EQ(infers, kThreads * kPerThread);
  CHECK(ordered);
  // Cancels of the last rids may come in a frame after the last Infer: read until all are in.
  const size_t cancels = static_cast<size_t>(kThreads * kPerThread / 7);
  while (cancel_after_infer.size() < cancels && executor.Read(&frame)) {
    for (const uint64_t rid : frame.cancel()) cancel_after_infer[rid] = rid <= last;
  }
  CHECK_EQ(cancel_after_infer.size(), cancels);
  bool all_after = true;
  for (const auto& [rid, after] : cancel_after_infer) all_after = all_after && after;
  CHECK(all_after);
  link.Close();  // answers what is in flight: every request, UNAVAILABLE
  CHECK_EQ(target.unavailable.load(), kThreads * kPerThread);
}

void TestLinkDefersWritesWhileRequestsAreInFlight() {
  // Inside DeferredWrites (a worker's thread), a request that finds none in flight is written at
  // once; later ones wait for FlushDeferredWrites (or the scope's end) and go in one frame.
  ConnectedLink connected("batchgate-unit-defer-" + std::to_string(getpid()));
  FakeExecutor& executor = connected.executor;
  CountingTarget& target = connected.target;
  batchgate::ExecutorLink& link = connected.link;
  auto submit = [&] { return connected.Submit(); };
  auto read_rids = [&] {
    batchgate::wire::ToExecutor frame;
    std::vector<uint64_t> rids;
    if (executor.Read(&frame)) {
      for (const auto& infer : frame.infer()) rids.push_back(infer.rid());
    }
    return rids;
  };
  uint64_t second = 0, fourth = 0;
  {
    const batchgate::ExecutorLink::DeferredWrites deferred;
    const uint64_t first = submit();
    CHECK(!batchgate::ExecutorLink::HasDeferredWrites());
    CHECK(read_rids() == std::vector<uint64_t>{first});
    second = submit();
    const uint64_t third = submit();
    CHECK(batchgate::ExecutorLink::HasDeferredWrites());
    CHECK(!executor.Pending());
    batchgate::ExecutorLink::FlushDeferredWrites();
    CHECK(!batchgate::ExecutorLink::HasDeferredWrites());
    CHECK((read_rids() == std::vector<uint64_t>{second, third}));
    fourth = submit();
    link.Cancel(second);  // joins the unwritten frame
    CHECK(!executor.Pending());
  }  // the scope's end writes what is left
  batchgate::wire::ToExecutor frame;
  CHECK(executor.Read(&frame));
  CHECK(frame.infer_size() == 1 && frame.infer(0).rid() == fourth);
  CHECK(frame.cancel_size() == 1 && frame.cancel(0) == second);
  // Outside the scope every request is written at once, in flight or not.
  const uint64_t fifth = submit();
  CHECK(read_rids() == std::vector<uint64_t>{fifth});
  link.Close();
  CHECK_EQ(target.unavailable.load(), 5);
}

void TestLinkGroupsRequestsOfOneFrame() {
  // Requests the front end marks groupable go in an InferGroup when they share a frame; a lone
  // one stays an Infer. Requests in a group are in flight like any other: closing the link
  // answers them.
  ConnectedLink connected("batchgate-unit-group-" + std::to_string(getpid()));
  FakeExecutor& executor = connected.executor;
  CountingTarget& target = connected.target;
  batchgate::ExecutorLink& link = connected.link;
  auto submit = [&] { return connected.Submit(MakeInfer(0, 1, {{1, 4}}, 0), true); };
  batchgate::wire::ToExecutor frame;
  {
    const batchgate::ExecutorLink::DeferredWrites deferred;
    const uint64_t first = submit();  // none in flight: written at once, alone
    CHECK(executor.Read(&frame));
    CHECK(frame.infer_size() == 1 && frame.infer(0).rid() == first && frame.groups_size() == 0);
    const uint64_t second = submit();
    const uint64_t third = submit();
    batchgate::ExecutorLink::FlushDeferredWrites();
    CHECK(executor.Read(&frame));
    CHECK(frame.infer_size() == 0 && frame.groups_size() == 1);
    CHECK(frame.groups(0).rids_size() == 2 && frame.groups(0).rids(0) == second &&
          frame.groups(0).rids(1) == third);
  }
  link.Close();
  CHECK_EQ(target.unavailable.load(), 3);
}

// Hands answers to the test's thread as a worker's mailbox would.
class MailboxTarget final : public batchgate::AnswerTarget, public batchgate::AnswerMailbox {
 public:
  batchgate::AnswerMailbox& mailbox() override { return *this; }
  void Post(std::vector<batchgate::PostedAnswer>& answers) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& posted : answers) answers_.push_back(std::move(posted.answer));
    answers.clear();
    ++posts;
    arrived_.notify_all();
  }
  // How many answers have come, without taking them.
  size_t Waiting() {
    std::lock_guard<std::mutex> lock(mu_);
    return answers_.size();
  }
  std::atomic<int> posts{0};
  void OnExecutorAnswer(batchgate::ExecutorAnswer /*answer*/) override {}
  batchgate::ExecutorAnswer Take() {
    std::unique_lock<std::mutex> lock(mu_);
    CHECK(arrived_.wait_for(lock, std::chrono::seconds(10), [&] { return !answers_.empty(); }));
    if (answers_.empty()) return {};
    batchgate::ExecutorAnswer answer = std::move(answers_.front());
    answers_.erase(answers_.begin());
    return answer;
  }

 private:
  std::mutex mu_;
  std::condition_variable arrived_;
  std::vector<batchgate::ExecutorAnswer> answers_;
};

batchgate::wire::ToFrontend ResultFor(uint64_t rid, uint64_t block) {
  batchgate::wire::ToFrontend frame;
  auto* result = frame.add_results();
  result->set_rid(rid);
  result->set_released(true);
  auto* output = result->add_outputs();
  output->set_block(block);
  output->set_offset(block);
  output->set_nbytes(16);
  return frame;
}

void TestLinkStopsReadingOutputsOfALostConnection() {
  // Two answers arrive; the first is being copied (an OutputRead holds), the second still waits
  // in its worker's mailbox when the executor drops the connection. The link says Hello again
  // only once the copy is done (the executor then reuses the blocks), and the waiting answer is
  // never read: it becomes UNAVAILABLE.
  const std::string name = "batchgate-unit-reads-" + std::to_string(getpid());
  FakeExecutor executor(name);
  batchgate::InputRegion region(0, 1 << 20);
  batchgate::ModelTable models;
  LinkEvents events;
  MailboxTarget copying, waiting;
  batchgate::ExecutorLink link(name, 0, region, models, events);
  link.Start();
  Welcome(executor, events);
  uint64_t first = 0, second = 0;
  grpc::Status refusal;
  CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {}, 1, &copying, &first,
                         &refusal));
  CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {}, 1, &waiting, &second,
                         &refusal));
  batchgate::wire::ToExecutor frame;
  int infers = 0;
  while (infers < 2 && executor.Read(&frame)) infers += frame.infer_size();
  executor.Write(ResultFor(first, 1 << 20));
  batchgate::ExecutorAnswer copied = copying.Take();
  CHECK(copied.result != nullptr);
  auto read = std::make_unique<batchgate::ExecutorLink::OutputRead>(link, copied);
  CHECK(read->ok());
  executor.Write(ResultFor(second, 2 << 20));
  batchgate::ExecutorAnswer unread = waiting.Take();
  std::atomic<int> order{0};
  int copy_done = 0, hello_came = 0;
  std::thread copier([&] {
    // Long enough for a link that does not wait to have said Hello already.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    copy_done = ++order;
    read.reset();
  });
  executor.CloseConnection();
  executor.Accept();
  CHECK(executor.Read(&frame) && frame.has_hello());
  hello_came = ++order;
  copier.join();
  CHECK(copy_done > 0 && copy_done < hello_came);
  {
    const batchgate::ExecutorLink::OutputRead late(link, unread);
    CHECK(!late.ok());
  }
  CHECK(unread.result == nullptr);
  CHECK_EQ(static_cast<int>(unread.status.error_code()),
           static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  link.Close();
}

void TestLinkKeepsInputsTheExecutorStillReads() {
  // Requests in flight when the connection is lost keep their input blocks; the next welcome
  // says which the executor still reads (held): the others are free again at once, the held
  // ones once released_inputs names them. A held block this process does not hold (its
  // predecessor's) is taken in the region until then.
  const std::string name = "batchgate-unit-kept-" + std::to_string(getpid());
  FakeExecutor executor(name);
  batchgate::InputRegion region(0, 1 << 20);
  batchgate::ModelTable models;
  LinkEvents events;
  CountingTarget target;
  batchgate::ExecutorLink link(name, 0, region, models, events);
  link.Start();
  Welcome(executor, events);
  const uint64_t read_still = *region.Allocate(1000);
  const uint64_t not_read = *region.Allocate(1000);
  uint64_t rid = 0;
  grpc::Status refusal;
  CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {read_still}, 1, &target,
                         &rid, &refusal));
  CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {not_read}, 1, &target,
                         &rid, &refusal));
  batchgate::wire::ToExecutor frame;
  int infers = 0;
  while (infers < 2 && executor.Read(&frame)) infers += frame.infer_size();
  executor.CloseConnection();
  executor.Accept();
  CHECK(executor.Read(&frame) && frame.has_hello());
  CHECK_EQ(region.bytes_in_use(), uint64_t{2048});  // both kept while disconnected
  const uint64_t predecessors = 512 << 10;
  batchgate::wire::ToFrontend welcome;
  welcome.set_welcome(true);
  auto* held = welcome.add_held();
  held->set_offset(read_still);
  held->set_nbytes(1000);
  held = welcome.add_held();
  held->set_offset(predecessors);
  held->set_nbytes(256);
  executor.Write(welcome);
  CHECK(events.WaitConnected());
  // A frame after the welcome is handled after it: once its reply comes, so has the welcome.
  MailboxTarget call_target;
  auto call = std::make_unique<batchgate::wire::Call>();
  call->mutable_index();
  CHECK(link.SubmitCall(std::move(call), &call_target, &refusal));
  while (executor.Read(&frame) && frame.call_size() == 0) {
  }
  batchgate::wire::ToFrontend reply;
  reply.add_replies()->set_cid(frame.call(0).cid());
  executor.Write(reply);
  call_target.Take();
  CHECK_EQ(region.bytes_in_use(), uint64_t{1024 + 256});  // not_read freed; the others taken
  CHECK(!region.Reserve(read_still, 1) && !region.Reserve(predecessors, 1));
  CHECK(region.Reserve(not_read, 1000) && region.Free(not_read));
  batchgate::wire::ToFrontend released;
  released.add_released_inputs(read_still);
  released.add_released_inputs(predecessors);
  released.add_replies()->set_cid(0);  // answers nothing: a marker only
  executor.Write(released);
  auto second = std::make_unique<batchgate::wire::Call>();
  second->mutable_index();
  CHECK(link.SubmitCall(std::move(second), &call_target, &refusal));
  while (executor.Read(&frame) && frame.call_size() == 0) {
  }
  batchgate::wire::ToFrontend second_reply;
  second_reply.add_replies()->set_cid(frame.call(0).cid());
  executor.Write(second_reply);
  call_target.Take();
  CHECK_EQ(region.bytes_in_use(), uint64_t{0});
  link.Close();
}


void TestLinkPostsAReadsAnswersAtOnce() {
  // Three results in one send come in one read: they reach their worker's mailbox as one post
  // (one lock, one doorbell), in the order they came. A frame past the limit then ends the
  // connection: the request still in flight is answered UNAVAILABLE and the link says Hello
  // again.
  const std::string name = "batchgate-unit-posts-" + std::to_string(getpid());
  FakeExecutor executor(name);
  batchgate::InputRegion region(0, 1 << 20);
  batchgate::ModelTable models;
  LinkEvents events;
  MailboxTarget target;
  batchgate::ExecutorLink link(name, 0, region, models, events);
  link.Start();
  Welcome(executor, events);
  uint64_t rids[4] = {};
  grpc::Status refusal;
  for (uint64_t& rid : rids) {
    CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {}, 1, &target, &rid,
                           &refusal));
  }
  batchgate::wire::ToExecutor frame;
  int infers = 0;
  while (infers < 4 && executor.Read(&frame)) infers += frame.infer_size();
  executor.WriteTogether({ResultFor(rids[0], 1 << 20), ResultFor(rids[1], 2 << 20),
                          ResultFor(rids[2], 3 << 20)});
  for (int i = 0; i < 3; ++i) {
    const batchgate::ExecutorAnswer answer = target.Take();
    CHECK(answer.result != nullptr && answer.result->rid() == rids[i]);
  }
  CHECK_EQ(target.posts.load(), 1);

  const uint32_t oversize = batchgate::wire::MAX_FRAME_BYTES + 1u;
  std::string prefix(4, '\0');
  for (int i = 0; i < 4; ++i) prefix[i] = static_cast<char>((oversize >> (8 * i)) & 0xFF);
  executor.WriteBytes(prefix);
  const batchgate::ExecutorAnswer lost = target.Take();
  CHECK(lost.result == nullptr);
  CHECK_EQ(static_cast<int>(lost.status.error_code()),
           static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  executor.CloseConnection();
  executor.Accept();
  CHECK(executor.Read(&frame) && frame.has_hello());
  link.Close();
}


void TestLinkFramesStayUnderTheLimit() {
  // Deferred entries pile up into one frame past wire.proto's limit: 15 MiB of requests, then a
  // call of 60 MiB. The writer splits the frame before the call goes in (its size is checked
  // before appending), so no frame passes MAX_FRAME_BYTES; a call too large for any frame is
  // refused up front.
  ConnectedLink connected("batchgate-unit-limit-" + std::to_string(getpid()));
  FakeExecutor& executor = connected.executor;
  batchgate::ExecutorLink& link = connected.link;
  const std::string id(1 << 20, 'i');
  CountingTarget call_target;
  constexpr int kInfers = 16;
  {
    const batchgate::ExecutorLink::DeferredWrites deferred;
    for (int i = 0; i < kInfers; ++i) {
      batchgate::wire::Infer infer;
      infer.set_id(id);
      connected.Submit(std::move(infer));
    }
    auto call = std::make_unique<batchgate::wire::Call>();
    call->mutable_statistics()->set_name(std::string(60 << 20, 'n'));
    grpc::Status refusal;
    CHECK(link.SubmitCall(std::move(call), &call_target, &refusal));
    auto too_large = std::make_unique<batchgate::wire::Call>();
    too_large->mutable_statistics()->set_name(std::string(batchgate::wire::MAX_FRAME_BYTES, 'n'));
    CHECK(!link.SubmitCall(std::move(too_large), &call_target, &refusal));
    CHECK_EQ(static_cast<int>(refusal.error_code()),
             static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
    CHECK_EQ(refusal.error_message(),
             std::string("the request is larger than the 67108864 bytes a front end forwards "
                         "to the executor process"));
  }
  int infers = 0, calls = 0;
  batchgate::wire::ToExecutor frame;
  while ((infers < kInfers || calls < 1) && executor.Read(&frame)) {
    infers += frame.infer_size();
    calls += frame.call_size();
  }
  CHECK_EQ(infers, kInfers);
  CHECK_EQ(calls, 1);
  CHECK(executor.largest_frame <= static_cast<uint64_t>(batchgate::wire::MAX_FRAME_BYTES));
  link.Close();
}

}  // namespace

void RunLinkTests() {
  TestLinkWritesEveryEntryInOrder();
  TestLinkDefersWritesWhileRequestsAreInFlight();
  TestLinkGroupsRequestsOfOneFrame();
  TestLinkFramesStayUnderTheLimit();
  TestLinkStopsReadingOutputsOfALostConnection();
  TestLinkKeepsInputsTheExecutorStillReads();
  TestLinkPostsAReadsAnswersAtOnce();
}
