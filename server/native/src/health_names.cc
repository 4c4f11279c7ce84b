#include "health_names.h"

#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/interceptor.h>

#include <string>
#include <string_view>
#include <vector>

#include "text.h"

namespace batchgate {
namespace {

// What gRPC's default health service accepts (default_health_check_service.cc).
constexpr size_t kMaxServiceNameBytes = 200;

// Whether `request` is a HealthCheckRequest (field 1, `service`, a UTF-8 string and nothing
// else) whose service name is longer than gRPC's health service takes.
bool HasLongServiceName(const grpc::ByteBuffer& request) {
  std::vector<grpc::Slice> slices;
  if (!request.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  google::protobuf::UnknownFieldSet fields;
  if (!fields.ParseFromString(bytes)) return false;
  const std::string* name = nullptr;
  for (int i = 0; i < fields.field_count(); ++i) {
    const auto& field = fields.field(i);
    if (field.number() != 1 || field.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) {
      return false;
    }
    name = &field.length_delimited();  // the last one wins, as when parsing
  }
  return name != nullptr && name->size() > kMaxServiceNameBytes && IsValidUtf8(*name);
}

class HealthNameInterceptor final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using Hook = grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(Hook::POST_RECV_MESSAGE)) {
      // The health service takes its requests raw: the message is still the ByteBuffer.
      const auto* request = static_cast<const grpc::ByteBuffer*>(methods->GetRecvMessage());
      long_name_ = request != nullptr && HasLongServiceName(*request);
    }
    if (long_name_ && methods->QueryInterceptionHookPoint(Hook::PRE_SEND_STATUS) &&
        methods->GetSendStatus().error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
      methods->ModifySendStatus(grpc::Status(grpc::StatusCode::NOT_FOUND, "service name unknown"));
    }
    methods->Proceed();
  }

 private:
  bool long_name_ = false;
};

class HealthNameInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // gRPC takes ownership of what this returns; nothing at all for every other method.
    if (std::string_view(info->method()) != "/grpc.health.v1.Health/Check") return nullptr;
    return new HealthNameInterceptor;
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> HealthNameInterceptors() {
  return std::make_unique<HealthNameInterceptorFactory>();
}

}  // namespace batchgate
