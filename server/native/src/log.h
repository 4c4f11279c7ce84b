// JSON log lines on stderr, one object per line, as the Python processes write them
// (server/logs.py: structlog's JSONRenderer after add_log_level and an ISO UTC TimeStamper).
//
// The supervisor reads every child's stderr line by line, parses the JSON ones, filters them by
// "level" and waits for the one with event "frontend_ready"; so each line is written with one
// write(2), never interleaved with another thread's, and never held up by a lock.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

namespace batchgate {

enum class LogLevel { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };

// One "key": value of a log line.
class LogField {
 public:
  LogField(std::string_view key, std::string_view value) : key_(key), kind_(kString), text_(value) {}
  LogField(std::string_view key, const char* value) : LogField(key, std::string_view(value)) {}
  LogField(std::string_view key, const std::string& value) : LogField(key, std::string_view(value)) {}
  LogField(std::string_view key, int value) : key_(key), kind_(kInt), int_(value) {}
  LogField(std::string_view key, long value) : key_(key), kind_(kInt), int_(value) {}
  LogField(std::string_view key, long long value) : key_(key), kind_(kInt), int_(value) {}
  LogField(std::string_view key, unsigned value) : key_(key), kind_(kInt), int_(value) {}
  LogField(std::string_view key, unsigned long value)
      : key_(key), kind_(kInt), int_(static_cast<int64_t>(value)) {}
  LogField(std::string_view key, unsigned long long value)
      : key_(key), kind_(kInt), int_(static_cast<int64_t>(value)) {}
  LogField(std::string_view key, double value) : key_(key), kind_(kFloat), float_(value) {}
  LogField(std::string_view key, bool value) : key_(key), kind_(kBool), int_(value) {}

  void AppendTo(std::string& out) const;
  std::string_view key() const { return key_; }

 private:
  enum Kind { kString, kInt, kFloat, kBool };
  std::string_view key_;
  Kind kind_;
  std::string_view text_;
  int64_t int_ = 0;
  double float_ = 0;
};

// Process-wide settings of the log: the level below which lines are dropped, and the slot that
// every line names (with "role": "frontend"). Set once, at start-up, before other threads run.
void SetLogLevel(LogLevel level);
void SetLogSlot(int slot);
// "debug", "info", "warning", "error" or "critical" (any case); false for anything else.
bool ParseLogLevel(std::string_view name, LogLevel* level);

bool LogEnabled(LogLevel level);

// {fields..., "event": event, "role": "frontend", "slot": N, "level": ..., "timestamp": ...}
void Log(LogLevel level, std::string_view event, std::initializer_list<LogField> fields = {});

// {"event": event, fields...}, whatever the level: how the supervisor learns that this
// process is ready (server/logs.py announce()).
void Announce(std::string_view event, std::initializer_list<LogField> fields);

// Routes gRPC's and protobuf's own log output into JSON lines (they would otherwise write
// their own formats on stderr).
void CaptureLibraryLogs();

}  // namespace batchgate
