"""Writes crates/tessera-apps/assets/digits/digits.bin.gz: scikit-learn's 8×8
handwritten digits (the UCI optical-recognition test set: 1,797 images,
pixel values 0–16, labels 0–9), for `tessera train --task digits`.

Format (gzip-compressed): the 4 bytes `TDG1`, the image count as a
little-endian u32, the labels (one byte each), then the pixels (64 bytes
per image, row-major, values 0–16).

Run once (needs scikit-learn); the output is committed:
    python3 scripts/gen_digits.py
"""
import gzip
import os
import struct

from sklearn.datasets import load_digits

d = load_digits()
images = d.images.astype("uint8")
labels = d.target.astype("uint8")
assert images.shape == (1797, 8, 8) and images.max() == 16
payload = b"TDG1" + struct.pack("<I", len(labels)) + labels.tobytes() + images.tobytes()
out = os.path.join(os.path.dirname(__file__), "..", "crates", "tessera-apps", "assets", "digits", "digits.bin.gz")
with open(out, "wb") as f:
    f.write(gzip.compress(payload, compresslevel=9, mtime=0))
print(f"wrote {len(labels)} images to {out}")
