"""Sends one unary request of raw bytes, well-formed or not, to a method of tracer's service and
prints its outcome as JSON: ["OK", response hex] or [status code, details].
Usage: raw_request.py SOCKET METHOD REQUEST_HEX"""
import json
import sys

import grpc


def main():
    socket, method, request = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
    # grpcio sends the socket path as :authority, which hyper rejects; any host name does.
    channel = grpc.insecure_channel(f"unix:{socket}", options=[("grpc.default_authority", "localhost")])
    rpc = channel.unary_unary(f"/tracer.v1.Tracer/{method}", request_serializer=None, response_deserializer=None)
    try:
        out = ["OK", rpc(request, timeout=20).hex()]
    except grpc.RpcError as e:
        out = [e.code().name, e.details()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
