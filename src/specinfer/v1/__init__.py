"""Generated gRPC/protobuf code of protos/specinfer/v1 (scripts/gen_protos.py); do not edit."""
