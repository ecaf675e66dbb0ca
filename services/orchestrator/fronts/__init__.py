"""The public fronts: gRPC and OpenAI HTTP, their parameter tables, and the generation service both run."""
