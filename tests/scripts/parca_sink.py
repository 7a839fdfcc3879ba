"""A gRPC server taking Parca's ProfileStoreService/WriteRaw, for tracer's continuous
profiling test: grpcio's generic handler, requests kept as raw bytes (no generated code).
Prints its port, then appends each request to OUT as a 4-byte big-endian length and the
request. usage: parca_sink.py OUT"""

import sys
from concurrent import futures

import grpc

METHOD = "/parca.profilestore.v1alpha1.ProfileStoreService/WriteRaw"


class Sink(grpc.GenericRpcHandler):
    def __init__(self, out):
        self.out = out

    def service(self, details):
        if details.method != METHOD:
            return None

        def write_raw(request, context):
            with open(self.out, "ab") as f:
                f.write(len(request).to_bytes(4, "big") + request)
            return b""  # an empty WriteRawResponse

        return grpc.unary_unary_rpc_method_handler(write_raw)


def main():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((Sink(sys.argv[1]),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
