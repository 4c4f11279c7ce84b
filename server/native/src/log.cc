#include "log.h"

#include <grpc/support/log.h>
#include <google/protobuf/stubs/logging.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <ctime>

#include "text.h"

namespace batchgate {
namespace {

LogLevel g_level = LogLevel::kInfo;
int g_slot = 0;

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "error";
}

// TimeStamper(fmt="iso", utc=True): 2024-05-01T12:34:56.123456Z.
void AppendTimestamp(std::string& out) {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  tm utc{};
  gmtime_r(&now.tv_sec, &utc);
  char buf[40];
  const size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &utc);
  std::snprintf(buf + n, sizeof buf - n, ".%06ldZ", now.tv_nsec / 1000);
  out += buf;
}

// One write(2) for the whole line: lines of several threads never interleave, up to the
// pipe's atomic size, and no lock is held if the reader of stderr is slow.
void WriteLine(std::string& line) {
  line += '\n';
  const char* data = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, data, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // stderr is gone: nothing to tell anyone
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
}

void AppendKey(std::string& out, std::string_view key) {
  AppendJsonString(out, key);
  out += ": ";
}

void GrpcLog(gpr_log_func_args* args) {
  LogLevel level = LogLevel::kError;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = LogLevel::kDebug;
  if (args->severity == GPR_LOG_SEVERITY_INFO) level = LogLevel::kInfo;
  if (!LogEnabled(level)) return;
  Log(level, "grpc_log", {LogField("message", args->message ? args->message : ""),
                          LogField("file", args->file ? args->file : ""),
                          LogField("line", args->line)});
}

void ProtobufLog(google::protobuf::LogLevel severity, const char* file, int line,
                 const std::string& message) {
  // protobuf logs almost only about what it was asked to parse (a client's string that is not
  // UTF-8, for one): a client's mistake, which its status already reports.
  const LogLevel level =
      severity == google::protobuf::LOGLEVEL_FATAL ? LogLevel::kError : LogLevel::kDebug;
  if (!LogEnabled(level)) return;
  Log(level, "protobuf_log",
      {LogField("message", message), LogField("file", file ? file : ""), LogField("line", line)});
}

}  // namespace

void LogField::AppendTo(std::string& out) const {
  AppendKey(out, key_);
  switch (kind_) {
    case kString: AppendJsonString(out, text_); break;
    case kInt: out += std::to_string(int_); break;
    case kFloat: out += PythonFloat(float_); break;
    case kBool: out += int_ ? "true" : "false"; break;
  }
}

void SetLogLevel(LogLevel level) { g_level = level; }
void SetLogSlot(int slot) { g_slot = slot; }

bool ParseLogLevel(std::string_view name, LogLevel* level) {
  std::string lower;
  for (const char c : name) lower += static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (lower == "debug") *level = LogLevel::kDebug;
  else if (lower == "info") *level = LogLevel::kInfo;
  else if (lower == "warning") *level = LogLevel::kWarning;
  else if (lower == "error" || lower == "critical") *level = LogLevel::kError;
  else return false;
  return true;
}

bool LogEnabled(LogLevel level) { return level >= g_level; }

void Log(LogLevel level, std::string_view event, std::initializer_list<LogField> fields) {
  if (!LogEnabled(level)) return;
  std::string line = "{";
  bool has_role = false, has_slot = false;
  for (const LogField& field : fields) {
    field.AppendTo(line);
    line += ", ";
    has_role = has_role || field.key() == "role";
    has_slot = has_slot || field.key() == "slot";
  }
  AppendKey(line, "event");
  AppendJsonString(line, event);
  // The process's context, unless the event named it itself (structlog's setdefault).
  if (!has_role) line += ", \"role\": \"frontend\"";
  if (!has_slot) line += ", \"slot\": " + std::to_string(g_slot);
  line += ", \"level\": \"";
  line += LevelName(level);
  line += "\", \"timestamp\": \"";
  AppendTimestamp(line);
  line += "\"}";
  WriteLine(line);
}

void Announce(std::string_view event, std::initializer_list<LogField> fields) {
  std::string line = "{";
  AppendKey(line, "event");
  AppendJsonString(line, event);
  for (const LogField& field : fields) {
    line += ", ";
    field.AppendTo(line);
  }
  line += "}";
  WriteLine(line);
}

void CaptureLibraryLogs() {
  gpr_set_log_function(GrpcLog);
  google::protobuf::SetLogHandler(ProtobufLog);
}

}  // namespace batchgate
