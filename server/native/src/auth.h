// Bearer tokens on the inference service, as server/frontend/auth.py checks them.
//
// The admin token guards the RPCs that change or reveal what is served (RepositoryModelLoad,
// RepositoryModelUnload, RepositoryIndex, LogSettings, TraceSetting) and the six shared-memory
// registration RPCs (they open files and device memory by name); the infer token every
// other inference-service RPC but ServerLive and ServerReady, which probes call without
// credentials. The admin token opens whatever the infer token opens. A call without
// `authorization: Bearer <token>` is UNAUTHENTICATED, one with a token that is not accepted
// PERMISSION_DENIED. Each check compares the token with every accepted one in time independent
// of where they differ. Nothing here logs or copies a token.
#pragma once

#include <grpcpp/server_context.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace batchgate {

// The token of the first `authorization` entry: "" when that entry holds no bearer token,
// nullopt when there is no such entry (server/frontend/auth.py bearer_token()).
std::optional<std::string_view> BearerToken(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata);

// Whether `a` and `b` are equal, in time that depends only on their lengths.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

class TokenAuth {
 public:
  // `methods`: the service's method names, in its declaration order (the method indexes).
  TokenAuth(const std::optional<std::string>& admin_token,
            const std::optional<std::string>& infer_token,
            const std::vector<std::string>& methods);

  // OK when the call may go on; else the refusal to finish it with. `log_method`: the full
  // method path, for the debug line a refusal writes.
  grpc::Status Check(int method, const grpc::ServerContext& context) const;

  bool enabled() const { return enabled_; }

 private:
  struct Rule {
    std::vector<std::string> accepted;  // empty: the method is open
    std::string path;                   // /inference.GRPCInferenceService/<name>
    grpc::Status missing;
    grpc::Status wrong;
  };
  bool enabled_ = false;
  std::vector<Rule> rules_;
};

}  // namespace batchgate
