// Unit tests: the wire's columns (a Batch's Results, Infers grouped) and the executor's frames
// read off a socket.
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

// An Infer of `model` with one tensor per shape in `shapes`, each in the arena at `offset`.
batchgate::wire::Infer MakeInfer(uint64_t rid, uint32_t model,
                                 const std::vector<std::vector<int64_t>>& shapes,
                                 uint64_t offset) {
  batchgate::wire::Infer infer;
  infer.set_rid(rid);
  infer.set_model(model);
  infer.set_batch_size(shapes.empty() || shapes[0].empty() ? 1 : shapes[0][0]);
  infer.set_priority(rid % 3);
  infer.set_deadline_ns(1000 + static_cast<int64_t>(rid));
  infer.set_timeout_us(10 * rid);
  infer.set_id("r" + std::to_string(rid));
  for (const auto& shape : shapes) {
    auto* tensor = infer.add_inputs();
    tensor->set_offset(offset);
    tensor->set_nbytes(64);
    for (const int64_t dim : shape) tensor->add_shape(dim);
  }
  return infer;
}

namespace {

using batchgate::DataType;
using batchgate::ModelState;

// A Batch stands for one Result per request (wire.proto).
void TestBatchResults() {
  batchgate::wire::Batch batch;
  for (const uint64_t rid : {7u, 9u}) batch.add_rids(rid);
  for (const uint64_t first : {0u, 3u}) batch.add_first_rows(first);
  for (const uint64_t rows : {3u, 1u}) batch.add_rows(rows);
  batch.set_released(true);
  auto* output = batch.add_outputs();
  output->set_block(4096);
  output->set_row_bytes(8);
  output->add_tail(2);
  std::vector<std::unique_ptr<batchgate::wire::Result>> results;
  CHECK(batchgate::AppendBatchResults(batch, &results));
  CHECK(results.size() == 2);
  CHECK(results[1]->rid() == 9 && results[1]->released());
  CHECK(results[1]->outputs_size() == 1);
  const auto& out = results[1]->outputs(0);
  CHECK(out.block() == 4096 && out.offset() == 4096 + 3 * 8 && out.nbytes() == 8);
  CHECK(out.shape_size() == 2 && out.shape(0) == 1 && out.shape(1) == 2);
  CHECK(results[0]->outputs(0).offset() == 4096 && results[0]->outputs(0).nbytes() == 24);
  batch.add_rows(5);  // the lists no longer line up: nothing is appended
  CHECK(!batchgate::AppendBatchResults(batch, &results));
  CHECK(results.size() == 2);
}


void TestGroupInfers() {
  // Requests that may share a group and have company go in one; lone ones, and those that may
  // not (SubmitInfer's flag false, an input in a client's region), stay Infers in their order.
  batchgate::wire::ToExecutor frame;
  *frame.add_infer() = MakeInfer(1, 1, {{1, 4}, {1, 2, 2}}, 100);
  *frame.add_infer() = MakeInfer(2, 1, {{1, 5}, {1, 2, 2}}, 200);  // another tail: alone
  *frame.add_infer() = MakeInfer(3, 1, {{3, 4}, {3, 2, 2}}, 300);  // joins rid 1
  *frame.add_infer() = MakeInfer(4, 2, {{1, 4}, {1, 2, 2}}, 400);  // another model: alone
  *frame.add_infer() = MakeInfer(5, 1, {{1, 4}, {1, 2, 2}}, 500);  // not groupable
  *frame.add_infer() = MakeInfer(6, 1, {{1, 4}, {1, 2, 2}}, 600);  // placed
  frame.mutable_infer(5)->mutable_inputs(1)->mutable_placement()->set_region("r");
  *frame.add_infer() = MakeInfer(7, 1, {{2, 4}, {2, 2, 2}}, 700);  // joins rid 1
  batchgate::GroupInfers(frame, {true, true, true, true, false, true, true});
  std::vector<uint64_t> left;
  for (const auto& infer : frame.infer()) left.push_back(infer.rid());
  CHECK((left == std::vector<uint64_t>{2, 4, 5, 6}));
  CHECK_EQ(frame.groups_size(), 1);
  const auto& group = frame.groups(0);
  CHECK(group.model() == 1);
  CHECK((std::vector<uint64_t>(group.rids().begin(), group.rids().end()) ==
         std::vector<uint64_t>{1, 3, 7}));
  CHECK((std::vector<uint32_t>(group.batch_sizes().begin(), group.batch_sizes().end()) ==
         std::vector<uint32_t>{1, 3, 2}));
  CHECK(group.priorities(1) == 0 && group.priorities(2) == 1);
  CHECK(group.deadlines_ns(2) == 1007 && group.timeouts_us(1) == 30 && group.ids(2) == "r7");
  CHECK_EQ(group.inputs_size(), 2);
  CHECK(group.inputs(0).tail_size() == 1 && group.inputs(0).tail(0) == 4);
  CHECK(group.inputs(1).tail_size() == 2 && group.inputs(1).tail(1) == 2);
  CHECK((std::vector<uint64_t>(group.inputs(1).offsets().begin(), group.inputs(1).offsets().end())
         == std::vector<uint64_t>{100, 300, 700}));

  // Nobody to share a group with: the frame stays as it is.
  batchgate::wire::ToExecutor alone;
  *alone.add_infer() = MakeInfer(1, 1, {{1, 4}}, 0);
  *alone.add_infer() = MakeInfer(2, 2, {{1, 4}}, 64);
  batchgate::GroupInfers(alone, {true, true});
  CHECK(alone.infer_size() == 2 && alone.groups_size() == 0);
  // Nor do requests without inputs: a group's requests are its offset columns.
  batchgate::wire::ToExecutor empty;
  *empty.add_infer() = MakeInfer(1, 1, {}, 0);
  *empty.add_infer() = MakeInfer(2, 1, {}, 0);
  batchgate::GroupInfers(empty, {true, true});
  CHECK(empty.infer_size() == 2 && empty.groups_size() == 0);
  // Nor do those whose rows are not their batch_size (a group's shapes are (batch_size, tail)).
  batchgate::wire::ToExecutor zero;
  *zero.add_infer() = MakeInfer(1, 1, {{0, 4}}, 0);
  *zero.add_infer() = MakeInfer(2, 1, {{0, 4}}, 64);
  zero.mutable_infer(0)->set_batch_size(1);
  zero.mutable_infer(1)->set_batch_size(1);
  batchgate::GroupInfers(zero, {true, true});
  CHECK(zero.infer_size() == 2 && zero.groups_size() == 0);
  // A group holds 4096 requests at most: the next ones of its kind start another, in order.
  batchgate::wire::ToExecutor many;
  constexpr int kMany = 4096 + 3;
  for (int i = 0; i < kMany; ++i) {
    *many.add_infer() = MakeInfer(static_cast<uint64_t>(i + 1), 1, {{1, 4}},
                                  static_cast<uint64_t>(i) * 16);
  }
  batchgate::GroupInfers(many, std::vector<bool>(kMany, true));
  CHECK(many.infer_size() == 0 && many.groups_size() == 2);
  CHECK(many.groups(0).rids_size() == 4096 && many.groups(1).rids_size() == 3);
  CHECK(many.groups(1).rids(0) == 4097 && many.groups(1).inputs(0).offsets(2) == (kMany - 1) * 16);
}


// A frame's bytes: its 4-byte little-endian length, then `body`.
std::string FrameOf(const std::string& body) {
  std::string bytes(4, '\0');
  const auto size = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((size >> (8 * i)) & 0xFF);
  return bytes + body;
}

void TestFrameReader() {
  // One read yields every whole frame the socket holds; a frame split across reads, or a
  // length prefix cut short, waits for its rest; a frame larger than one read gets room of its
  // own; a length past the limit is refused before its body is read.
  using Status = batchgate::FrameReader::Status;
  int fds[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  const auto send_bytes = [&](const std::string& bytes) {
    CHECK(send(fds[0], bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(bytes.size()));
  };
  const auto next = [](batchgate::FrameReader& reader) -> std::string {
    const char* body = nullptr;
    uint32_t size = 0;
    if (!reader.Next(&body, &size)) return "<none>";
    return std::string(body, size);
  };
  batchgate::FrameReader reader(1000);
  send_bytes(FrameOf("one") + FrameOf("") + FrameOf("three"));
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("one"));
  CHECK_EQ(next(reader), std::string(""));
  CHECK_EQ(next(reader), std::string("three"));
  CHECK_EQ(next(reader), std::string("<none>"));
  CHECK_EQ(reader.buffered(), size_t{0});

  const std::string split = FrameOf("split across reads");
  send_bytes(split.substr(0, 2));  // half a length prefix
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("<none>"));
  CHECK_EQ(reader.buffered(), size_t{2});
  send_bytes(split.substr(2, 7));  // the rest of the prefix, part of the body
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("<none>"));
  send_bytes(split.substr(9) + FrameOf("after"));
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("split across reads"));
  CHECK_EQ(next(reader), std::string("after"));
  CHECK_EQ(next(reader), std::string("<none>"));

  // Reads of 16 bytes: the first brings the prefix, the second all the rest of a 100-byte body.
  batchgate::FrameReader small(1000, 16);
  const std::string large(100, 'L');
  send_bytes(FrameOf(large));
  int fills = 0;
  std::string got = "<none>";
  while (got == "<none>" && fills < 10 && small.Fill(fds[1]) == Status::kFrames) {
    ++fills;
    got = next(small);
  }
  CHECK_EQ(got, large);
  CHECK_EQ(fills, 2);

  // 1001 bytes, one past the limit: refused at its prefix, and its body is never read.
  send_bytes(FrameOf(std::string(1001, 'x')).substr(0, 4));
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("<none>"));
  send_bytes(std::string(1001, 'x'));
  CHECK(reader.Fill(fds[1]) == Status::kOversize);
  CHECK_EQ(reader.oversize_bytes(), uint32_t{1001});
  char byte = 0;
  CHECK(recv(fds[1], &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 1);  // still in the socket
  CHECK(reader.buffered() <= size_t{4});

  batchgate::FrameReader closed(1000);
  close(fds[0]);
  while (recv(fds[1], &byte, 1, MSG_DONTWAIT) > 0) {
  }
  CHECK(closed.Fill(fds[1]) == Status::kClosed);
  close(fds[1]);
}

}  // namespace

void RunWireTests() {
  TestBatchResults();
  TestGroupInfers();
  TestFrameReader();
}
