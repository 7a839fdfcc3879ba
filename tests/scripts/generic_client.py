"""A generic gRPC client that knows nothing of tracer.proto: it discovers the service through
server reflection (grpcio-reflection), checks health (grpcio-health-checking), and calls the
API with messages built from the reflected descriptors. Usage: generic_client.py SOCKET"""
import json
import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

SERVICE = "tracer.v1.Tracer"


def main():
    # grpcio sends the socket path as :authority, which HTTP/2 servers built on hyper reject as
    # malformed; any plain host name does.
    channel = grpc.insecure_channel(f"unix:{sys.argv[1]}", options=[("grpc.default_authority", "localhost")])
    out = {}

    db = ProtoReflectionDescriptorDatabase(channel)
    out["services"] = sorted(db.get_services())
    pool = descriptor_pool.DescriptorPool(db)
    service = pool.FindServiceByName(SERVICE)
    out["methods"] = sorted(m.name for m in service.methods)

    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
    out["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def call(method, fields):
        m = service.FindMethodByName(method)
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        rpc = channel.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString,
        )
        try:
            return json_format.MessageToDict(rpc(json_format.ParseDict(fields, req_cls()))), None
        except grpc.RpcError as e:
            return None, [e.code().name, e.details()]

    caps, _ = call("GetCapabilities", {})
    out["capabilities"] = caps
    out["list"], _ = call("ListSessions", {})
    # Status codes for bad requests.
    out["errors"] = {
        "no_mode": call("StartSession", {"target": {"pid": 1}})[1],
        "zero_duration": call("StartSession", {"mode": "MODE_COUNTING", "target": {"pid": 1}, "durationMs": "0"})[1],
        "no_such_pid": call("StartSession", {"mode": "MODE_COUNTING", "target": {"pid": 999999999}})[1],
        "bad_event": call("StartSession", {"mode": "MODE_COUNTING", "target": {"all": True}, "counting": {"events": ["bogus"]}})[1],
        "tracing_options_elsewhere": call("StartSession", {"mode": "MODE_COUNTING", "target": {"all": True}, "tracing": {"bufferMb": 8}})[1],
        "huge_trace_buffer": call("StartSession", {"mode": "MODE_TRACING", "target": {"all": True}, "tracing": {"bufferMb": 100000}})[1],
        "stacks_without_cuda": call("StartSession", {"mode": "MODE_COUNTING", "target": {"all": True}, "counting": {"cudaStacks": True}})[1],
        "driver_only_without_cuda": call("StartSession", {"mode": "MODE_COUNTING", "target": {"all": True}, "counting": {"cudaDriverOnly": True}})[1],
        "bad_frequency": call("StartSession", {"mode": "MODE_SAMPLING", "target": {"all": True}, "sampling": {"frequencyHz": "20000"}})[1],
        "no_session": call("GetSession", {"id": "nope"})[1],
    }
    started, err = call("StartSession", {"mode": "MODE_COUNTING", "target": {"all": True}, "durationMs": "200"})
    out["started"] = started or err
    print(json.dumps(out))


if __name__ == "__main__":
    main()
