// The link's reader thread: connecting, Hello, the executor's frames, a lost connection and the
// reconnect (executor_link.h says what each keeps).
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "executor_link.h"
#include "frame_reader.h"
#include "input_region.h"
#include "link_frames.h"
#include "log.h"
#include "model_table.h"
#include "text.h"
#include "wire_columns.h"

namespace batchgate {
namespace {

constexpr auto kReconnectInterval = std::chrono::milliseconds(50);
// A connection lost sooner than this after it was made (an executor that accepts and drops,
// or crashes at once) is tried again after a delay that doubles from kReconnectInterval up to
// kMaxReconnectDelay; one that lasted is tried again at once.
constexpr auto kStableSession = std::chrono::seconds(1);
constexpr auto kMaxReconnectDelay = std::chrono::milliseconds(2000);
// The executor_lost warning of connections lost soon after they were made, at most this often.
constexpr auto kLostLogInterval = std::chrono::seconds(10);
constexpr int kSocketBufferBytes = 4 << 20;
const char* const kRestarting = "the executor is restarting";

bool SameUser(int fd) {
  ucred peer{};
  socklen_t length = sizeof peer;
  return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) == 0 && peer.uid == getuid();
}

grpc::StatusCode CodeOf(uint32_t number) {
  // Numbers gRPC does not define are UNKNOWN (server/frontend/errors.py grpc_code()); so is 0, which no
  // failure can carry.
  return number >= 1 && number <= 16 ? static_cast<grpc::StatusCode>(number)
                                     : grpc::StatusCode::UNKNOWN;
}


}  // namespace

void AnswerPosts::Add(AnswerTarget* target, ExecutorAnswer answer) {
  AnswerMailbox* const mailbox = &target->mailbox();
  // A handful of workers: a short scan.
  size_t box = 0;
  while (box < used_ && boxes_[box].mailbox != mailbox) ++box;
  if (box == used_) {
    if (used_ == boxes_.size()) boxes_.emplace_back();
    boxes_[used_++].mailbox = mailbox;
  }
  boxes_[box].answers.push_back(PostedAnswer{target, std::move(answer)});
}

void AnswerPosts::PostAll() {
  for (size_t i = 0; i < used_; ++i) {
    boxes_[i].mailbox->Post(boxes_[i].answers);
    boxes_[i].answers.clear();  // Post() took them; its capacity stays
  }
  used_ = 0;
}

void ExecutorLink::ReadLoop() {
  pthread_setname_np(pthread_self(), "bg-link-read");
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return;
    }
    const auto started = std::chrono::steady_clock::now();
    std::chrono::milliseconds wait = kReconnectInterval;  // nobody listens yet
    if (Session()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return;
      wait = NoteLoss(std::chrono::steady_clock::now() - started);
    }
    if (wait.count() > 0) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_reader_.wait_for(lock, wait, [&] { return closing_; });
    }
  }
}

std::chrono::milliseconds ExecutorLink::NoteLoss(std::chrono::steady_clock::duration session) {
  const auto now = std::chrono::steady_clock::now();
  const bool lasted = session >= kStableSession;
  using Delay = std::chrono::milliseconds;
  reconnect_delay_ =
      lasted ? Delay(0)
             : std::min<Delay>(kMaxReconnectDelay,
                               std::max<Delay>(kReconnectInterval, reconnect_delay_ * 2));
  ++losses_unlogged_;
  if (lasted || last_lost_log_ == std::chrono::steady_clock::time_point{} ||
      now - last_lost_log_ >= kLostLogInterval) {
    Log(LogLevel::kWarning, "executor_lost",
        {LogField("slot", static_cast<int>(slot_)), LogField("losses", losses_unlogged_),
         LogField("reconnect_in_ms", static_cast<int64_t>(reconnect_delay_.count()))});
    losses_unlogged_ = 0;
    last_lost_log_ = now;
  }
  return reconnect_delay_;
}

bool ExecutorLink::Session() {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (socket_name_.size() + 1 > sizeof address.sun_path) return false;
  // Abstract namespace: a leading NUL, and no file anywhere.
  std::memcpy(address.sun_path + 1, socket_name_.data(), socket_name_.size());
  const auto length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + socket_name_.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    close(fd);
    return false;
  }
  // An abstract socket has no file permissions: only a process of this user may be the
  // executor, or another user could read what clients sent and answer for the executor.
  if (!SameUser(fd)) {
    Log(LogLevel::kDebug, "executor_refused",
        {LogField("reason", "the socket is served by another user's process")});
    close(fd);
    return false;
  }
  for (const int option : {SO_SNDBUF, SO_RCVBUF}) {
    setsockopt(fd, SOL_SOCKET, option, &kSocketBufferBytes, sizeof kSocketBufferBytes);
  }
  auto socket = std::make_shared<Socket>(fd);
  std::string buffer;
  {
    // The first frame carries Hello and nothing else; it goes out before the writer can see
    // this socket.
    wire::ToExecutor hello;
    hello.mutable_hello()->set_slot(slot_);
    if (!SendFrame(fd, hello, buffer)) return true;
  }
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) return true;
    socket_ = socket;
    welcomed_ = false;
    generation = ++generation_;
    readable_generation_.store(generation);
    pending_.Clear();
    pending_groupable_.clear();
    pending_urgent_ = pending_frees_ = false;
  }
  // Every whole frame one read brings is handled before the next read, and their answers go
  // to each worker as one post.
  FrameReader reader(kMaxFrameBytes);
  wire::ToFrontend frame;
  bool open = true;
  while (open) {
    const FrameReader::Status status = reader.Fill(fd);
    if (status == FrameReader::Status::kClosed) break;
    if (status == FrameReader::Status::kOversize) {
      Log(LogLevel::kError, "executor_protocol_error",
          {LogField("error", "the executor sent a " + std::to_string(reader.oversize_bytes()) +
                                 "-byte frame")});
      break;
    }
    const char* body = nullptr;
    uint32_t size = 0;
    while (reader.Next(&body, &size)) {
      if (!frame.ParseFromArray(body, static_cast<int>(size))) {
        Log(LogLevel::kError, "executor_protocol_error",
            {LogField("error", "the executor sent a malformed frame")});
        open = false;
        break;
      }
      HandleFrame(frame, generation);
      frame.Clear();  // keeps the messages allocated, for the next frames to reuse
    }
    posts_.PostAll();
  }
  bool closing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing = closing_;
  }
  Lose(closing);
  return true;
}

void ExecutorLink::HandleFrame(wire::ToFrontend& frame, uint64_t generation) {
  // 0. what the welcome says of the lost connections' input blocks: before any model is
  // served, so that no request can be given one of them.
  if (frame.welcome()) SettleKeptInputs(frame);
  for (const uint64_t offset : frame.released_inputs()) {
    if (kept_inputs_.erase(offset) && !region_.Free(offset)) {
      Log(LogLevel::kError, "input_block_unknown", {LogField("offset", offset)});
    }
  }
  // 1. models (and the welcome)
  if (frame.welcome() || frame.models_size() > 0) {
    bool connected;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (frame.welcome()) welcomed_ = true;
      connected = welcomed_;
    }
    for (const auto& change : models_.Apply(frame.models(), frame.welcome(), connected, generation)) {
      observer_.OnModelChange(change.name, change.serving);
    }
    if (frame.welcome()) {
      Log(LogLevel::kInfo, "executor_connected",
          {LogField("slot", static_cast<int>(slot_)), LogField("models", frame.models_size())});
      observer_.OnConnectionChange(true, static_cast<size_t>(frame.models_size()));
    }
  }

  // 2.-3. results and failures: each to its request's worker.
  std::vector<uint64_t>& released = released_;
  released.clear();
  std::vector<std::unique_ptr<wire::Result>> orphans;
  // Taken out of the frame in its order, so that a stream answers in the order results came;
  // a batch's after them.
  std::vector<wire::Result*> extracted(static_cast<size_t>(frame.results_size()));
  frame.mutable_results()->ExtractSubrange(0, frame.results_size(), extracted.data());
  std::vector<std::unique_ptr<wire::Result>> results(extracted.begin(), extracted.end());
  for (const wire::Batch& batch : frame.batches()) {
    if (!AppendBatchResults(batch, &results)) {
      Log(LogLevel::kError, "executor_protocol_error",
          {LogField("error", std::string("a batch's rids, first_rows and rows differ in length"))});
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto settle = [&](uint64_t rid, bool inputs_released) -> AnswerTarget* {
      const auto it = infers_.find(rid);
      if (it == infers_.end()) return nullptr;
      AnswerTarget* target = it->second.target;
      if (inputs_released) {
        released.insert(released.end(), it->second.blocks.begin(), it->second.blocks.end());
      } else {
        unreleased_.emplace(rid, std::move(it->second.blocks));
      }
      infers_.erase(it);
      return target;
    };
    for (std::unique_ptr<wire::Result>& result : results) {
      AnswerTarget* target = settle(result->rid(), result->released());
      if (target == nullptr) {
        orphans.push_back(std::move(result));
        continue;
      }
      ExecutorAnswer answer;
      answer.generation = generation;
      answer.result = std::move(result);
      posts_.Add(target, std::move(answer));
    }
    for (const wire::Failure& failure : frame.failures()) {
      AnswerTarget* target = settle(failure.rid(), failure.released());
      if (target == nullptr) continue;
      ExecutorAnswer answer;
      answer.generation = generation;
      answer.status = grpc::Status(CodeOf(failure.code()), Bounded(failure.message()));
      posts_.Add(target, std::move(answer));
    }
    // 4. released: inputs of requests answered earlier with released false.
    for (const uint64_t rid : frame.released()) {
      const auto it = unreleased_.find(rid);
      if (it == unreleased_.end()) continue;
      released.insert(released.end(), it->second.begin(), it->second.end());
      unreleased_.erase(it);
    }
    // 5. replies to calls
    std::vector<wire::Reply*> replies(static_cast<size_t>(frame.replies_size()));
    frame.mutable_replies()->ExtractSubrange(0, frame.replies_size(), replies.data());
    for (wire::Reply* released_reply : replies) {
      std::unique_ptr<wire::Reply> reply(released_reply);
      const auto it = calls_.find(reply->cid());
      if (it == calls_.end()) continue;
      ExecutorAnswer answer;
      answer.generation = generation;
      if (reply->has_error()) {
        answer.status = grpc::Status(CodeOf(reply->error().code()), Bounded(reply->error().message()));
      } else {
        answer.reply = std::move(reply);
      }
      posts_.Add(it->second, std::move(answer));
      calls_.erase(it);
    }
  }
  FreeBlocks(released);
  for (const auto& orphan : orphans) {
    // No request of ours has this rid (an executor bug): still return its output blocks.
    Log(LogLevel::kWarning, "executor_unknown_request", {LogField("rid", orphan->rid())});
    FreeOutputs(generation, *orphan);
  }
}

void ExecutorLink::SettleKeptInputs(const wire::ToFrontend& welcome) {
  std::unordered_map<uint64_t, uint64_t> still;
  for (const wire::InputBlock& block : welcome.held()) {
    if (!kept_inputs_.count(block.offset()) && !region_.Reserve(block.offset(), block.nbytes())) {
      Log(LogLevel::kError, "input_block_unknown", {LogField("offset", block.offset())});
      continue;
    }
    still.emplace(block.offset(), block.nbytes());
  }
  for (const auto& [offset, nbytes] : kept_inputs_) {
    if (!still.count(offset) && !region_.Free(offset)) {
      Log(LogLevel::kError, "input_block_unknown", {LogField("offset", offset)});
    }
  }
  kept_inputs_.swap(still);
}

ExecutorLink::OutputRead::OutputRead(ExecutorLink& link, ExecutorAnswer& answer) : link_(link) {
  if (!answer.result) return;
  // Counted before the generation is read: Lose() clears the generation, then waits for the
  // count, so a read it does not wait for is one that saw the generation gone.
  link_.output_reads_.fetch_add(1);
  if (link_.readable_generation_.load() == answer.generation) {
    reading_ = true;
    return;
  }
  link_.EndOutputRead();
  answer.result.reset();
  answer.status = grpc::Status(grpc::StatusCode::UNAVAILABLE, kRestarted);
}

ExecutorLink::OutputRead::~OutputRead() {
  if (reading_) link_.EndOutputRead();
}

void ExecutorLink::EndOutputRead() {
  // Only StopReadingOutputs() waits, and only once the generation is cleared.
  if (output_reads_.fetch_sub(1) == 1 && readable_generation_.load() == 0) {
    std::lock_guard<std::mutex> lock(reads_mu_);
    reads_done_.notify_all();
  }
}

void ExecutorLink::StopReadingOutputs() {
  readable_generation_.store(0);
  std::unique_lock<std::mutex> lock(reads_mu_);
  reads_done_.wait(lock, [&] { return output_reads_.load() == 0; });
}

void ExecutorLink::Lose(bool closing) {
  // Before anything else, and before the next Hello: the lost connection's output blocks are
  // the executor's again once it has that Hello.
  StopReadingOutputs();
  std::unordered_map<uint64_t, PendingInfer> infers;
  std::unordered_map<uint64_t, std::vector<uint64_t>> unreleased;
  std::unordered_map<uint64_t, AnswerTarget*> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    socket_.reset();
    welcomed_ = false;
    infers.swap(infers_);
    unreleased.swap(unreleased_);
    calls.swap(calls_);
    pending_.Clear();
    pending_groupable_.clear();
    pending_urgent_ = pending_frees_ = false;
    if (!handoff_.empty()) {
      // The rest of a frame for the lost connection, not taken yet: it goes nowhere, and the
      // token it held is free.
      handoff_.clear();
      handoff_socket_.reset();
      writing_ = false;
    }
  }
  // The executor may still read them (it lives on, and a batch of it runs): kept until the
  // next welcome says which it does.
  for (const auto& [rid, pending] : infers) {
    for (const uint64_t offset : pending.blocks) kept_inputs_.emplace(offset, 0);
  }
  for (const auto& [rid, blocks] : unreleased) {
    for (const uint64_t offset : blocks) kept_inputs_.emplace(offset, 0);
  }
  const grpc::Status lost(grpc::StatusCode::UNAVAILABLE, kRestarted);
  for (const auto& [rid, pending] : infers) {
    ExecutorAnswer answer;
    answer.status = lost;
    posts_.Add(pending.target, std::move(answer));
  }
  for (const auto& [cid, target] : calls) {
    ExecutorAnswer answer;
    answer.status = lost;
    posts_.Add(target, std::move(answer));
  }
  posts_.PostAll();
  for (const auto& change : models_.Disconnect(kRestarting)) {
    observer_.OnModelChange(change.name, change.serving);
  }
  if (!closing) observer_.OnConnectionChange(false, 0);  // ReadLoop logs it (NoteLoss)
}

void ExecutorLink::FreeBlocks(const std::vector<uint64_t>& blocks) {
  for (const uint64_t offset : blocks) {
    if (!region_.Free(offset)) {
      Log(LogLevel::kError, "input_block_unknown", {LogField("offset", offset)});
    }
  }
}

}  // namespace batchgate
