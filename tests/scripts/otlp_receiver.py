"""OpenTelemetry profiles, read with the OpenTelemetry project's own Python classes
(opentelemetry-proto): the ground truth for tracer's OTLP export.

usage: otlp_receiver.py decode FILE   -- prints the request in FILE as JSON rows
       otlp_receiver.py serve OUT     -- an OTLP gRPC receiver of ProfilesService/Export:
                                         prints its port, appends each request to OUT as a
                                         4-byte big-endian length and the request
       otlp_receiver.py reject OUT    -- the same, answering that it rejected every profile
       ... serve OUT CERT KEY CA       -- over TLS, asking for a client certificate of CA

A row is [pid, tid, stack leaf first as "name:line", the sample's value in each profile]."""

import json
import sys
from concurrent import futures

from opentelemetry.proto.collector.profiles.v1development import (
    profiles_service_pb2 as service,
    profiles_service_pb2_grpc as service_grpc,
)


def value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def decode(data):
    req = service.ExportProfilesServiceRequest.FromString(data)
    d = req.dictionary
    s = d.string_table
    zero = (
        s[0] == ""
        and d.location_table[0].ByteSize() == 0
        and d.stack_table[0].ByteSize() == 0
        and d.function_table[0].ByteSize() == 0
        and d.mapping_table[0].ByteSize() == 0
        and d.attribute_table[0].ByteSize() == 0
    )
    types, rows, resources = [], [], []
    for rp in req.resource_profiles:
        attrs = {a.key: value(a.value) for a in rp.resource.attributes}
        resources.append(attrs)
        pid = attrs["process.pid"]
        first = len(rows)
        for k, prof in enumerate(rp.scope_profiles[0].profiles):
            t = (s[prof.sample_type.type_strindex], s[prof.sample_type.unit_strindex])
            if len(types) == k:
                types.append(t)
            assert types[k] == t, (types, t)
            for i, x in enumerate(prof.samples):
                assert len(x.values) == 1, x
                if k > 0:
                    rows[first + i][3].append(x.values[0])
                    continue
                sample_attrs = {
                    s[d.attribute_table[a].key_strindex]: value(d.attribute_table[a].value)
                    for a in x.attribute_indices
                }
                names = []
                for li in d.stack_table[x.stack_index].location_indices:
                    loc = d.location_table[li]
                    f = d.function_table[loc.lines[0].function_index]
                    names.append("%s:%d" % (s[f.name_strindex], loc.lines[0].line))
                rows.append([pid, sample_attrs["thread.id"], names, [x.values[0]]])
    return {"zero_entries": zero, "types": types, "rows": rows, "resources": resources}


class Receiver(service_grpc.ProfilesServiceServicer):
    def __init__(self, out, reject):
        self.out = out
        self.reject = reject

    def Export(self, request, context):
        data = request.SerializeToString()
        with open(self.out, "ab") as f:
            f.write(len(data).to_bytes(4, "big") + data)
        answer = service.ExportProfilesServiceResponse()
        if self.reject:
            n = sum(len(sp.profiles) for rp in request.resource_profiles for sp in rp.scope_profiles)
            answer.partial_success.rejected_profiles = n
            answer.partial_success.error_message = "this receiver takes none"
        return answer


def main():
    if sys.argv[1] == "decode":
        with open(sys.argv[2], "rb") as f:
            print(json.dumps(decode(f.read())))
        return
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = Receiver(sys.argv[2], sys.argv[1] == "reject")
    service_grpc.add_ProfilesServiceServicer_to_server(receiver, server)
    if len(sys.argv) > 3:
        cert, key, ca = (open(p, "rb").read() for p in sys.argv[3:6])
        creds = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )
        port = server.add_secure_port("127.0.0.1:0", creds)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
