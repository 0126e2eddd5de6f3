// Tensor files in the safetensors format (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the
// raw little-endian data. epx reads and writes F32, BF16 and I64.
#pragma once

#include <map>
#include <string>

#include "epx/tensor/tensor.hpp"

namespace epx {

using TensorMap = std::map<std::string, Tensor>;  // sorted by name, as safetensors lists them

// Throws InputError naming the file (and tensor) for a missing file, a corrupt header, offsets
// outside the data, or an unsupported dtype.
TensorMap read_safetensors(const std::string& path);

// Writes to PATH.tmp, then renames, so a failed write never leaves a half-written PATH.
void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The named tensor with the expected shape, a float dtype (F32 or BF16) and finite values, or an
// InputError that names the tensor, the file, what was found and what was expected.
const Tensor& expect_tensor(const TensorMap& tensors, const std::string& name,
                            const Shape& shape, const std::string& file);

}  // namespace epx
