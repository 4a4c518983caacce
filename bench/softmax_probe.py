"""Is a half-precision softmax with a half output bit-identical to stock's float32 softmax
rounded to half (`F.softmax(x, -1, dtype=float32).to(half)`, eager_attention_forward's)?

    python -m bench.softmax_probe     (GPU machine)

For every span 1..2100 and each dtype: rows shaped like a decode call's scores (heads, 1,
span), scaled as attention scores are; prints the spans where the two differ. One kernel
instead of two per layer if they never do.
"""

import torch
import torch.nn.functional as F


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        differ = []
        for span in range(1, 2101):
            for scale in (1.0, 4.0, 12.0):
                x = (torch.randn(32, 1, span, device="cuda", generator=g) * scale).to(dtype)
                stock = F.softmax(x, dim=-1, dtype=torch.float32).to(dtype)
                fused = F.softmax(x, dim=-1)
                if not torch.equal(stock, fused):
                    differ.append((span, scale))
        print(f"{str(dtype):16} spans 1-2100 x 3 scales: {len(differ)} differ; first {differ[:8]}")


if __name__ == "__main__":
    main()
