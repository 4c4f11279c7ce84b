// The connection to the executor process: protos/wire.proto's front-end end.
//
// One Unix stream socket in the abstract namespace, frames of a 4-byte little-endian length and
// one serialized message (ToExecutor out, ToFrontend in). Two threads own the socket:
//
//   - writing: gRPC workers append Infer / cancel / free / Call entries to the pending
//     ToExecutor under the mutex. The thread that finds nobody writing takes the write token,
//     swaps the whole frame out and writes it outside the lock, without blocking; entries
//     appended meanwhile go in its next frame. So a request goes out on the thread that
//     decoded it (no hand-off to wake), one write carries every entry that was ready, and no
//     lock is ever held across a socket write. The writer thread writes what a worker could
//     not (a full socket buffer: the rest of a frame, blocking), and returned output blocks
//     that no request's frame carried within kFreeDelay;
//   - the reader: connects (again every 50 ms until the executor listens), checks that the
//     peer runs as this user, sends Hello alone, then reads whole frames and handles each in
//     one pass in the order wire.proto gives: models, results, failures, released, replies.
//
// Answers go to the gRPC worker that owns the request (its AnswerMailbox), never handled on the
// reader thread: building a reply copies the outputs out of the arena, and that work spreads
// over the workers like the requests do. The reader takes whatever the socket holds in one
// read (FrameReader), handles every whole frame in it, then posts each worker the answers of
// all of them at once.
//
// When the connection is lost every request and call in flight is answered UNAVAILABLE, models
// turn UNAVAILABLE, and the reader connects again; the next welcome restores everything. What
// the lost connection's executor may still read or write is not reused (wire.proto: "A lost
// connection does not end that ownership"):
//   - output blocks: an answer is read (copied into its reply) only inside an OutputRead, which
//     holds only while its connection is the current one. Lose() first makes every answer of
//     the lost connection unreadable (an answer still in a worker's mailbox is then answered
//     UNAVAILABLE), then waits for the copies under way; only then does the reader say Hello
//     again, which is what lets the executor reuse those blocks;
//   - input blocks of the requests left in flight or unreleased are kept, not freed: the next
//     welcome lists those a batch of the executor still reads (held), which stay taken until
//     released_inputs names them, and frees the others;
//   - a connection the executor drops soon after it was made (kStableSession) is tried again
//     after a delay that doubles up to kMaxReconnectDelay, and the warning is logged at most
//     once per kLostLogInterval, with the number of losses since the last one; a connection
//     that lasted starts afresh.
#pragma once

#include <grpcpp/support/status.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "protos/wire.pb.h"

namespace batchgate {

class InputRegion;
class ModelTable;

// What the executor answered to one request or call, as its worker receives it.
struct ExecutorAnswer {
  // The connection the answer came over: output blocks are returned only on that one.
  uint64_t generation = 0;
  grpc::Status status;                    // the Failure / Reply.error, or a lost connection
  std::unique_ptr<wire::Result> result;   // an Infer's outputs, when status is OK
  std::unique_ptr<wire::Reply> reply;     // a Call's reply, when status is OK
};

class AnswerMailbox;

// Something waiting for an executor answer: an inference request or a forwarded call.
class AnswerTarget {
 public:
  // Where its answer is posted: the worker the gRPC call lives on.
  virtual AnswerMailbox& mailbox() = 0;
  // On the mailbox's thread, exactly once per submitted Infer or Call.
  virtual void OnExecutorAnswer(ExecutorAnswer answer) = 0;

 protected:
  ~AnswerTarget() = default;
};

// One answer and the target it is for.
struct PostedAnswer {
  AnswerTarget* target;
  ExecutorAnswer answer;
};

// A thread that answers targets (Worker): the link's reader posts it every answer of one read
// at once, so that a read costs each worker one lock and one wake-up, not one per answer.
class AnswerMailbox {
 public:
  // Any thread (the link's): takes every answer of `answers` (left empty, its capacity kept),
  // each to be handed to its target's OnExecutorAnswer on this mailbox's thread, in order.
  virtual void Post(std::vector<PostedAnswer>& answers) = 0;

 protected:
  ~AnswerMailbox() = default;
};

// The answers of one read, by mailbox, until they are posted; the reader thread's, kept
// between reads so that their memory is reused.
class AnswerPosts {
 public:
  void Add(AnswerTarget* target, ExecutorAnswer answer);
  // One Post() per mailbox that has answers.
  void PostAll();

 private:
  struct Box {
    AnswerMailbox* mailbox;
    std::vector<PostedAnswer> answers;
  };
  std::vector<Box> boxes_;  // those past used_ are empty, kept for their memory
  size_t used_ = 0;
};

// What the link tells the rest of the front end, on the reader thread.
class LinkObserver {
 public:
  // The welcome arrived (`connected`, with the number of models) or the connection was lost.
  virtual void OnConnectionChange(bool connected, size_t models) = 0;
  // Models whose state changed: health follows.
  virtual void OnModelChange(const std::string& name, bool serving) = 0;

 protected:
  ~LinkObserver() = default;
};

class ExecutorLink {
 public:
  ExecutorLink(std::string socket_name, uint32_t slot, InputRegion& region, ModelTable& models,
               LinkObserver& observer);
  ~ExecutorLink();

  void Start();
  // Stops connecting, closes the connection and answers everything still in flight (as a lost
  // connection does, without the executor_lost warning). Idempotent.
  void Close();

  // Queues `infer` (inputs already in `blocks`) for `target`, and sets `rid` to the rid it
  // chose. False with `refusal` when there is no connection, or it is not the one the model
  // state came over; the blocks are then still the caller's. `groupable`: the request may go
  // in an InferGroup (wire.proto: a batching model, every input in the arena and of a
  // fixed-size datatype, every output asked for in the reply, in the model's order).
  bool SubmitInfer(std::unique_ptr<wire::Infer> infer, std::vector<uint64_t> blocks,
                   uint64_t model_generation, AnswerTarget* target, uint64_t* rid,
                   grpc::Status* refusal, bool groupable = false);
  // The client of `rid` went away: the executor drops it from its queue.
  void Cancel(uint64_t rid);
  // The outputs of a result that came over connection `generation` were copied out.
  void FreeOutputs(uint64_t generation, const wire::Result& result);

  // Where a worker reads an answer's output blocks: for its lifetime, while ok(), the blocks
  // are not reused (Lose() waits for it). Not ok() when the answer's connection is gone: its
  // result was dropped, and its status says UNAVAILABLE. Not moved, not copied; a worker's only.
  class OutputRead {
   public:
    OutputRead(ExecutorLink& link, ExecutorAnswer& answer);
    ~OutputRead();
    OutputRead(const OutputRead&) = delete;
    OutputRead& operator=(const OutputRead&) = delete;
    bool ok() const { return reading_; }

   private:
    ExecutorLink& link_;
    bool reading_ = false;
  };
  // Queues a control-plane call (its cid set here) for `target`; false with `refusal` when not
  // connected.
  bool SubmitCall(std::unique_ptr<wire::Call> call, AnswerTarget* target, grpc::Status* refusal);

  // Inference requests sent and not yet answered.
  size_t InFlightInfers() const;

  // While a thread is inside a DeferredWrites scope, the entries it queues (requests, cancels,
  // calls) while other requests are in flight are not written at once: FlushDeferredWrites()
  // writes them, and so does the scope's end. A worker flushes whenever its completion queue
  // has no event ready, so that the requests it takes in one go leave in one frame; one that
  // finds no request in flight is written at once.
  class DeferredWrites {
   public:
    DeferredWrites();
    ~DeferredWrites();
    DeferredWrites(const DeferredWrites&) = delete;
    DeferredWrites& operator=(const DeferredWrites&) = delete;
  };
  static void FlushDeferredWrites();
  // Whether this thread left an entry unwritten.
  static bool HasDeferredWrites();

 private:
  struct Socket;
  struct PendingInfer {
    AnswerTarget* target;
    std::vector<uint64_t> blocks;
  };

  void ReadLoop();
  void WriteLoop();
  // One connection, from connect to loss; false when it could not connect.
  bool Session();
  void HandleFrame(wire::ToFrontend& frame, uint64_t generation);
  // The welcome's held input blocks: kept (taken in the region if this process does not hold
  // them); every other kept block is free again.
  void SettleKeptInputs(const wire::ToFrontend& welcome);
  // Lose(): no answer of the lost connection is read from now on, and none is being read.
  void StopReadingOutputs();
  void EndOutputRead();
  void Lose(bool closing);
  // After a connection that lasted `session`: how long to wait before connecting again, and the
  // warning (rate-limited).
  std::chrono::milliseconds NoteLoss(std::chrono::steady_clock::duration session);
  void FreeBlocks(const std::vector<uint64_t>& blocks);
  // After a new entry (`urgent`: anything but returned output blocks): an urgent one is written
  // now, on this thread, unless another thread holds the write token; returned blocks wait.
  void Flush(std::unique_lock<std::mutex>& lock, bool urgent);
  // With the write token: writes the pending frame, and again while urgent entries came
  // meanwhile (a few rounds). Gives the token back, or to the writer thread when the socket
  // buffer was full.
  void WriteNow(std::unique_lock<std::mutex>& lock);

  const std::string socket_name_;
  const uint32_t slot_;
  InputRegion& region_;
  ModelTable& models_;
  LinkObserver& observer_;

  mutable std::mutex mu_;
  std::condition_variable wake_writer_;
  std::condition_variable wake_reader_;  // interrupts the 50 ms reconnect wait
  bool closing_ = false;
  std::shared_ptr<Socket> socket_;  // the current connection; null when none
  bool welcomed_ = false;           // the welcome of the current connection arrived
  uint64_t generation_ = 0;         // counts connections
  uint64_t next_id_ = 1;            // rids and cids, unique over every connection
  wire::ToExecutor pending_;        // the next frame
  std::vector<bool> pending_groupable_;  // per Infer of pending_: SubmitInfer's `groupable`
  bool pending_urgent_ = false;     // it holds an Infer, cancel or Call
  bool pending_frees_ = false;      // it holds returned output blocks
  std::chrono::steady_clock::time_point frees_since_;  // when the first of them was returned
  bool writing_ = false;            // the write token: one thread writes to the socket at a time
  // The rest of a frame a worker could not write (the socket buffer was full): the writer
  // thread holds the write token until it has written it, to `handoff_socket_`.
  std::string handoff_;
  std::shared_ptr<Socket> handoff_socket_;
  enum class WriterState { kBusy, kIdle, kHoldingFrees } writer_state_ = WriterState::kBusy;
  std::unordered_map<uint64_t, PendingInfer> infers_;                 // rid -> request
  std::unordered_map<uint64_t, std::vector<uint64_t>> unreleased_;   // rid -> input blocks
  std::unordered_map<uint64_t, AnswerTarget*> calls_;                 // cid -> call
  // Input blocks of lost connections' requests (offset -> bytes), until a welcome says which
  // the executor still reads; the reader thread's, outside the lock.
  std::unordered_map<uint64_t, uint64_t> kept_inputs_;

  // OutputRead: the connection whose answers may be read (0: none), and the reads under way.
  std::atomic<uint64_t> readable_generation_{0};
  std::atomic<int> output_reads_{0};
  std::mutex reads_mu_;
  std::condition_variable reads_done_;

  // The reconnect delay after a connection lost soon after it was made, and the warning's
  // rate limit (the reader thread's).
  std::chrono::milliseconds reconnect_delay_{0};
  std::chrono::steady_clock::time_point last_lost_log_{};
  int losses_unlogged_ = 0;

  // The reader thread's: the answers of the read under way, and the blocks a frame releases.
  AnswerPosts posts_;
  std::vector<uint64_t> released_;

  std::thread reader_;
  std::thread writer_;
};

}  // namespace batchgate
