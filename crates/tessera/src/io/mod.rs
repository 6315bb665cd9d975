//! File formats: .npy and safetensors.
