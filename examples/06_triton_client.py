"""06: a Triton client: text in, embedding and the served budget out.

    elastic-export serve elastic-out                   # in another shell: a real Triton server
    python examples/06_triton_client.py "How do I open a file?" "Use the with statement."

Sends the texts to the router (``elastic``) over gRPC three times: naming no budget (the router's
load-adaptive policy picks), asking for sparsity 0.3 as a request parameter, and one budget per text
as the ``sparsity`` input. Prints what came back. Needs ``tritonclient[grpc]`` (the ``serve`` extra).
"""

import argparse

import numpy as np
import tritonclient.grpc as grpcclient

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("texts", nargs="+")
ap.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC endpoint (serve's --port + 1)")
ap.add_argument("--model", default="elastic", help="the router's name")
args = ap.parse_args()

client = grpcclient.InferenceServerClient(args.url)
text = grpcclient.InferInput("text", [len(args.texts)], "BYTES")
text.set_data_from_numpy(np.array([t.encode() for t in args.texts], dtype=object))
outputs = [grpcclient.InferRequestedOutput(n) for n in ("sentence_embedding", "served_sparsity", "served_precision")]

per_row = grpcclient.InferInput("sparsity", [len(args.texts), 1], "FP32")  # one budget per text
per_row.set_data_from_numpy(np.linspace(0.0, 0.5, len(args.texts), dtype=np.float32).reshape(-1, 1))

for label, inputs, params in (("policy's choice", [text], None), ("parameter 0.3", [text], {"sparsity": 0.3}),
                              ("one per row", [text, per_row], None)):
    res = client.infer(args.model, inputs, outputs=outputs, parameters=params, client_timeout=60)
    emb = res.as_numpy("sentence_embedding")
    served = res.as_numpy("served_sparsity").ravel().tolist()
    precision = res.as_numpy("served_precision").ravel()[0].decode()
    print(f"{label}: embeddings {emb.shape}, norm {np.linalg.norm(emb[0]):.3f}, served sparsity {served} ({precision})")
client.close()
