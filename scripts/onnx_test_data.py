#!/usr/bin/env python3
"""Writes the `onnx` package's backend test data into one folder.

The wheel ships the model-level cases (`pytorch-converted`,
`pytorch-operator`, `simple`, `light`) under onnx/backend/test/data; the
node-level cases are generated from the package's own case definitions
(onnx/backend/test/case/node, expected outputs computed there with numpy),
as `backend-test-tools generate-data` does for the model cases. Layout:
OUT/<kind>/<case>/model.onnx and test_data_set_N/{input,output}_M.pb, with
OUT/light/*.onnx copied as they are.

usage: onnx_test_data.py OUT
"""

import os
import shutil
import sys

import onnx
from onnx import numpy_helper
from onnx.backend.test.case.node import collect_testcases


def write_tensor(path, value, name):
    with open(path, "wb") as f:
        if isinstance(value, onnx.TensorProto):
            f.write(value.SerializeToString())
        elif isinstance(value, list):
            f.write(numpy_helper.from_list(value, name).SerializeToString())
        elif isinstance(value, dict):
            f.write(numpy_helper.from_dict(value, name).SerializeToString())
        elif value is None or isinstance(value, onnx.OptionalProto):
            f.write(numpy_helper.from_optional(value, name).SerializeToString())
        else:
            f.write(numpy_helper.from_array(value, name).SerializeToString())


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    shipped = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
    for kind in ("pytorch-converted", "pytorch-operator", "simple", "light"):
        dst = os.path.join(out, kind)
        if os.path.exists(dst):
            shutil.rmtree(dst)
        shutil.copytree(os.path.join(shipped, kind), dst)
    written = 0
    for case in collect_testcases():
        case_dir = os.path.join(out, "node", case.name)
        if os.path.exists(case_dir):
            shutil.rmtree(case_dir)
        os.makedirs(case_dir)
        with open(os.path.join(case_dir, "model.onnx"), "wb") as f:
            f.write(case.model.SerializeToString())
        graph = case.model.graph
        for i, (inputs, outputs) in enumerate(case.data_sets):
            data_dir = os.path.join(case_dir, f"test_data_set_{i}")
            os.makedirs(data_dir)
            for j, value in enumerate(inputs):
                name = graph.input[j].name if j < len(graph.input) else f"input_{j}"
                write_tensor(os.path.join(data_dir, f"input_{j}.pb"), value, name)
            for j, value in enumerate(outputs):
                name = graph.output[j].name if j < len(graph.output) else f"output_{j}"
                write_tensor(os.path.join(data_dir, f"output_{j}.pb"), value, name)
        written += 1
    print(f"onnx {onnx.__version__}: {written} node cases and the shipped model cases in {out}")


if __name__ == "__main__":
    main()
