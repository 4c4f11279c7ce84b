// NOT_FOUND, not INVALID_ARGUMENT, for a health check of a long service name.
//
// gRPC's default health service (which serves grpc.health.v1.Health here) refuses a service
// name of more than 200 bytes as a request it "could not parse". The Python front end's health
// service answers NOT_FOUND, as for any name it does not serve, and probes and tests rely on
// that (tests/test_security.py). This interceptor, created for Health/Check calls only, turns
// that refusal into NOT_FOUND when the request was in fact a well-formed HealthCheckRequest.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <memory>

namespace batchgate {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> HealthNameInterceptors();

}  // namespace batchgate
