"""The verifier's and drafter's gRPC clients: streams, deadlines, replicas."""
