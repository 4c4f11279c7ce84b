#include "wire_scan.h"

#include <algorithm>
#include <limits>

namespace batchgate {

WireLimits UnlimitedWireLimits() {
  WireLimits limits;
  for (int i = 0; i < kWireRules; ++i) limits.most[i] = std::numeric_limits<uint64_t>::max();
  return limits;
}

namespace {

constexpr int kMaxDepth = 100;  // protobuf's recursion limit
// What one value of InferTensorContents' numeric fields (1-7) takes parsed, by field number.
constexpr uint64_t kParsedWidth[8] = {0, 1, 4, 8, 4, 8, 4, 8};
// A run of unpacked values that mixes fields counts this many bytes parsed per byte sent
// (server/frontend/request_scan.py _MIXED_RUN_FACTOR).
constexpr uint64_t kMixedRunFactor = 4;

// The tags of numeric values sent one field each, in one byte (request_scan.py _UNPACKED_TAGS).
bool IsUnpackedTag(uint32_t tag) {
  return tag == 0x08 || tag == 0x10 || tag == 0x18 || tag == 0x20 || tag == 0x28 ||
         tag == 0x35 || tag == 0x39;
}

// The bytes of `spans` as one sequence, read forwards; positions are offsets from the start.
class WireReader {
 public:
  explicit WireReader(const std::vector<WireSpan>& spans) : spans_(spans) { Enter(0, 0); }

  uint64_t position() const { return base_ + static_cast<uint64_t>(p_ - begin_); }

  // The next byte, if the bytes go on before `end`.
  bool Byte(uint64_t end, uint8_t* byte) {
    if (position() >= end) return false;
    while (p_ == stop_) {
      if (next_ >= spans_.size()) return false;
      Enter(next_, base_ + static_cast<uint64_t>(stop_ - begin_));
    }
    *byte = *p_++;
    return true;
  }

  // Moves to `to` (ahead, within the bytes: the caller checked it against a length).
  void SeekTo(uint64_t to) {
    while (base_ + static_cast<uint64_t>(stop_ - begin_) < to && next_ < spans_.size()) {
      Enter(next_, base_ + static_cast<uint64_t>(stop_ - begin_));
    }
    p_ = begin_ + (to - base_);
  }

  // The bytes before `end` that end a varint (those under 0x80), counted from here a span at
  // a time until the count passes `room`; the position is left where it was.
  uint64_t VarintEnds(uint64_t end, uint64_t room) const {
    uint64_t count = 0;
    const uint8_t* p = p_;
    const uint8_t* stop = stop_;
    uint64_t base = base_ + static_cast<uint64_t>(p_ - begin_);
    size_t next = next_;
    while (base < end) {
      const uint64_t here = std::min<uint64_t>(static_cast<uint64_t>(stop - p), end - base);
      for (uint64_t i = 0; i < here; ++i) count += p[i] < 0x80;
      if (count > room) break;
      base += here;
      if (next >= spans_.size()) break;
      p = spans_[next].data;
      stop = p + spans_[next].size;
      ++next;
    }
    return count;
  }

 private:
  void Enter(size_t index, uint64_t base) {
    if (index < spans_.size()) {
      begin_ = p_ = spans_[index].data;
      stop_ = begin_ + spans_[index].size;
    } else {
      begin_ = p_ = stop_ = nullptr;
    }
    base_ = base;
    next_ = index + 1;
  }

  const std::vector<WireSpan>& spans_;
  const uint8_t* begin_ = nullptr;  // the current span
  const uint8_t* p_ = nullptr;
  const uint8_t* stop_ = nullptr;
  uint64_t base_ = 0;  // the current span's first byte's position
  size_t next_ = 0;    // the span after it
};

// One scan; each step returns false to stop, with result_ saying why.
class Scan {
 public:
  Scan(const std::vector<WireSpan>& spans, const WireLimits& limits)
      : reader_(spans), limits_(limits) {
    for (const WireSpan& span : spans) size_ += span.size;
  }

  ScanResult Request() {
    uint64_t parameters = 0;
    while (reader_.position() < size_) {
      uint32_t tag;
      if (!Tag(size_, &tag)) return result_;
      const uint32_t field = tag >> 3;
      if ((tag & 7) != 2) {
        if (!Other(tag, size_, 0)) return result_;
        continue;
      }
      uint64_t length, stop;
      if (!Length(size_, &length, &stop)) return result_;
      bool ok = true;
      switch (field) {
        case 7: ok = Count(&raw_, WireRule::kRawInputContents); break;
        case 5: ok = Count(&inputs_, WireRule::kInputs) && Tensor(stop); break;
        case 6: ok = Count(&outputs_, WireRule::kOutputs) && Output(stop); break;
        case 1:
        case 2:
        case 3: ok = Name(length); break;
        case 4: ok = Count(&parameters, WireRule::kParameters) && Entry(stop, 1); break;
        default: ok = CountUnknown(); break;
      }
      if (!ok) return result_;
      reader_.SeekTo(stop);
    }
    return result_;
  }

 private:
  // An InferInputTensor (level 1).
  bool Tensor(uint64_t end) {
    uint64_t dimensions = 0;
    uint64_t parameters = 0;
    while (reader_.position() < end) {
      uint32_t tag;
      if (!Tag(end, &tag)) return false;
      const uint32_t field = tag >> 3;
      if ((tag & 7) != 2) {
        if (tag == 0x18) {  // shape, one unpacked dimension
          uint64_t value;
          if (!Count(&dimensions, WireRule::kDimensions) || !Varint(end, 10, &value)) return false;
        } else if (!Other(tag, end, 1)) {
          return false;
        }
        continue;
      }
      uint64_t length, stop;
      if (!Length(end, &length, &stop)) return false;
      bool ok = true;
      switch (field) {
        case 1:
        case 2: ok = Name(length); break;
        case 3: {  // shape, packed
          const uint64_t most = limits_.Most(WireRule::kDimensions);
          dimensions += reader_.VarintEnds(stop, most - dimensions);
          ok = dimensions <= most || Refuse(WireRule::kDimensions);
          break;
        }
        case 4: ok = Count(&parameters, WireRule::kParameters) && Entry(stop, 2); break;
        case 5: ok = Contents(stop); break;
        default: ok = CountUnknown(); break;
      }
      if (!ok) return false;
      reader_.SeekTo(stop);
    }
    return true;
  }

  // A run of numeric values sent one field each (single-byte tags, one after the other), as
  // server/frontend/request_scan.py matches one: counted when it ends.
  struct UnpackedRun {
    bool active = false;
    bool mixed = false;   // of more than one field
    uint32_t field = 0;   // its first value's
    uint64_t start = 0;   // where its first value's tag is
    uint64_t stop = 0;    // where its last whole value ends
    uint64_t parsed = 0;  // the bytes its values take parsed
  };

  // An InferTensorContents (level 2): its bytes_contents counted, and its numeric values'
  // bytes as parsed; the rest skipped. A run of unpacked values is counted when it ends, before
  // whatever ends it is looked at (a value cut short, too), as request_scan.py counts it.
  bool Contents(uint64_t end) {
    UnpackedRun run;
    while (reader_.position() < end) {
      const uint64_t at = reader_.position();
      uint32_t tag;
      if (!Tag(end, &tag)) return EndRun(&run) && false;
      const uint32_t field = tag >> 3;
      const uint32_t wire_type = tag & 7;
      if (reader_.position() - at == 1 && IsUnpackedTag(tag)) {
        uint64_t value;
        if (!(wire_type == 0 ? Varint(end, 10, &value) : Fixed(end, wire_type == 5 ? 4 : 8))) {
          return EndRun(&run) && false;  // the run ends before the value cut short
        }
        if (!run.active) {
          run = UnpackedRun{true, false, field, at, at, 0};
        } else if (field != run.field) {
          run.mixed = true;
        }
        run.parsed += kParsedWidth[field];
        run.stop = reader_.position();
        continue;
      }
      if (!EndRun(&run)) return false;
      if (wire_type == 2) {
        uint64_t length, stop;
        if (!Length(end, &length, &stop)) return false;
        if (field == 8) {
          if (!Count(&strings_, WireRule::kBytesContents)) return false;
        } else if (field > 8) {
          if (!CountUnknown()) return false;
        } else {  // 1-7 packed: values of their own type
          const uint64_t width = kParsedWidth[field];
          uint64_t values;
          if (field >= 6) {
            values = length / width;
          } else {
            const uint64_t most = limits_.Most(WireRule::kContentsBytes);
            values = reader_.VarintEnds(stop, (most - std::min(most, contents_bytes_)) / width);
          }
          if (!AddContents(values * width)) return false;
        }
        reader_.SeekTo(stop);
      } else if (wire_type == 0 && field <= 5) {
        uint64_t value;
        if (!Varint(end, 10, &value) || !AddContents(kParsedWidth[field])) return false;
      } else if ((wire_type == 5 && field == 6) || (wire_type == 1 && field == 7)) {
        if (!Fixed(end, wire_type == 5 ? 4 : 8) || !AddContents(kParsedWidth[field])) return false;
      } else if (!Other(tag, end, 2)) {
        return false;
      }
    }
    return EndRun(&run);
  }

  // Counts the run that ends here, if one was going on; false when that passes the rule (the
  // refusal then stands, whatever stopped the run).
  bool EndRun(UnpackedRun* run) {
    if (!run->active) return true;
    run->active = false;
    return AddContents(run->mixed ? kMixedRunFactor * (run->stop - run->start) : run->parsed);
  }

  bool AddContents(uint64_t parsed) {
    contents_bytes_ += parsed;
    return contents_bytes_ <= limits_.Most(WireRule::kContentsBytes) ||
           Refuse(WireRule::kContentsBytes);
  }

  // An InferRequestedOutputTensor (level 1).
  bool Output(uint64_t end) {
    uint64_t parameters = 0;
    while (reader_.position() < end) {
      uint32_t tag;
      if (!Tag(end, &tag)) return false;
      if ((tag & 7) != 2) {
        if (!Other(tag, end, 1)) return false;
        continue;
      }
      uint64_t length, stop;
      if (!Length(end, &length, &stop)) return false;
      bool ok = true;
      switch (tag >> 3) {
        case 1: ok = Name(length); break;
        case 2: ok = Count(&parameters, WireRule::kParameters) && Entry(stop, 2); break;
        default: ok = CountUnknown(); break;
      }
      if (!ok) return false;
      reader_.SeekTo(stop);
    }
    return true;
  }

  // A parameters map's entry: key = 1 (a string), value = 2 (an InferParameter).
  bool Entry(uint64_t end, int level) {
    while (reader_.position() < end) {
      uint32_t tag;
      if (!Tag(end, &tag)) return false;
      if ((tag & 7) != 2) {
        if (!Other(tag, end, level)) return false;
        continue;
      }
      uint64_t length, stop;
      if (!Length(end, &length, &stop)) return false;
      bool ok = true;
      switch (tag >> 3) {
        case 1: ok = Name(length); break;
        case 2: ok = Parameter(stop, level + 1); break;
        default: ok = CountUnknown(); break;
      }
      if (!ok) return false;
      reader_.SeekTo(stop);
    }
    return true;
  }

  // An InferParameter: bool = 1, int64 = 2, string = 3, double = 4, uint64 = 5.
  bool Parameter(uint64_t end, int level) {
    while (reader_.position() < end) {
      uint32_t tag;
      if (!Tag(end, &tag)) return false;
      if (tag == 0x08 || tag == 0x10 || tag == 0x28) {
        uint64_t value;
        if (!Varint(end, 10, &value)) return false;
      } else if (tag == 0x21) {
        if (!Fixed(end, 8)) return false;
      } else if ((tag & 7) == 2) {
        uint64_t length, stop;
        if (!Length(end, &length, &stop)) return false;
        if (!(tag == 0x1A ? Name(length) : CountUnknown())) return false;
        reader_.SeekTo(stop);
      } else if (!Other(tag, end, level)) {
        return false;
      }
    }
    return true;
  }

  // A field that is not length-delimited and that no rule counts: checked, counted as
  // unknown and skipped.
  bool Other(uint32_t tag, uint64_t end, int level) {
    const uint32_t wire_type = tag & 7;
    if (wire_type > 5 || wire_type == 4) return Malformed();  // 4: a group ends, none began
    if (!CountUnknown()) return false;
    uint64_t value;
    switch (wire_type) {
      case 0: return Varint(end, 10, &value);
      case 1: return Fixed(end, 8);
      case 3: return Group(tag >> 3, end, level + 1);
      default: return Fixed(end, 4);
    }
  }

  // An unknown group's fields (each one unknown), up to its end.
  bool Group(uint32_t field, uint64_t end, int level) {
    if (level > kMaxDepth) return Malformed();
    while (reader_.position() < end) {
      uint32_t tag;
      if (!Tag(end, &tag)) return false;
      const uint32_t wire_type = tag & 7;
      if (wire_type == 4) return (tag >> 3) == field || Malformed();
      if (wire_type == 2) {
        uint64_t length, stop;
        if (!Length(end, &length, &stop) || !CountUnknown()) return false;
        reader_.SeekTo(stop);
      } else if (!Other(tag, end, level)) {
        return false;
      }
    }
    return Malformed();
  }

  // -- the wire format -----------------------------------------------------------------------

  bool Varint(uint64_t end, int most_bytes, uint64_t* value) {
    uint64_t result = 0;
    for (int i = 0; i < most_bytes; ++i) {
      uint8_t byte;
      if (!reader_.Byte(end, &byte)) return Malformed();
      result |= static_cast<uint64_t>(byte & 0x7F) << (7 * i);
      if (byte < 0x80) {
        *value = result;
        return true;
      }
    }
    return Malformed();
  }

  bool Tag(uint64_t end, uint32_t* tag) {
    uint64_t value;
    if (!Varint(end, 5, &value)) return false;
    if (value < 8 || value > 0xFFFFFFFFu) return Malformed();  // field number 0; past 32 bits
    *tag = static_cast<uint32_t>(value);
    return true;
  }

  // A length-delimited field's length, and where it ends (by `end`); read as protobuf reads a
  // size: at most five bytes, under 2**31.
  bool Length(uint64_t end, uint64_t* length, uint64_t* stop) {
    if (!Varint(end, 5, length)) return false;
    if (*length >= (uint64_t{1} << 31) || *length > end - reader_.position()) return Malformed();
    *stop = reader_.position() + *length;
    return true;
  }

  bool Fixed(uint64_t end, uint64_t bytes) {
    if (bytes > end - reader_.position()) return Malformed();
    reader_.SeekTo(reader_.position() + bytes);
    return true;
  }

  // -- the rules -----------------------------------------------------------------------------

  bool Count(uint64_t* count, WireRule rule) {
    return ++*count <= limits_.Most(rule) || Refuse(rule);
  }
  bool CountUnknown() { return Count(&unknown_, WireRule::kUnknownFields); }
  bool Name(uint64_t length) {
    return length <= limits_.Most(WireRule::kNameBytes) || Refuse(WireRule::kNameBytes);
  }

  bool Refuse(WireRule rule) {
    result_.outcome = ScanOutcome::kOverLimit;
    result_.rule = rule;
    return false;
  }
  bool Malformed() {
    result_.outcome = ScanOutcome::kMalformed;
    return false;
  }

  WireReader reader_;
  const WireLimits& limits_;
  uint64_t size_ = 0;
  uint64_t inputs_ = 0, raw_ = 0, outputs_ = 0, strings_ = 0, unknown_ = 0;
  uint64_t contents_bytes_ = 0;  // typed contents' values, as parsed
  ScanResult result_;
};

}  // namespace

ScanResult ScanInferRequest(const std::vector<WireSpan>& spans, const WireLimits& limits) {
  return Scan(spans, limits).Request();
}

}  // namespace batchgate
