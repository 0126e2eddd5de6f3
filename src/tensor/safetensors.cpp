#include "epx/tensor/safetensors.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"

namespace epx {
namespace {

// A header larger than this is not a tensor file (the reference implementation caps it at 100 MB).
constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;

DType parse_dtype(const std::string& s, const std::string& name, const std::string& path) {
  if (s == "F32") return DType::F32;
  if (s == "BF16") return DType::BF16;
  if (s == "I64") return DType::I64;
  throw InputError(fmt::format(
      "{}: tensor '{}' has dtype {}; epx reads F32, BF16 and I64 (convert it, e.g. "
      "tensor.float() in PyTorch, before saving)",
      path, name, s));
}

}  // namespace

TensorMap read_safetensors(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(fmt::format("{}: is a directory; give a .safetensors file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot open the tensor file: {}", path, std::strerror(errno)));
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  if (end < 0) throw InputError(fmt::format("{}: cannot tell the tensor file's size (not a regular file?)", path));
  const auto file_size = static_cast<std::uint64_t>(end);
  in.seekg(0);
  unsigned char len_bytes[8] = {};
  if (file_size < 8 || !in.read(reinterpret_cast<char*>(len_bytes), 8))
    throw InputError(fmt::format("{}: not a safetensors file ({} bytes, shorter than the 8-byte "
                                 "header length)", path, file_size));
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > kMaxHeaderBytes || 8 + header_len > file_size)
    throw InputError(fmt::format("{}: corrupt safetensors file: header length {} does not fit in "
                                 "the file's {} bytes", path, header_len, file_size));
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json j;
  // A tensor named twice would be read as its last entry: the header's names are told apart.
  std::set<std::string> names;
  std::optional<std::string> twice;
  const auto name_once = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && !names.insert(parsed.get<std::string>()).second)
      twice = parsed.get<std::string>();
    return true;
  };
  try {
    j = nlohmann::json::parse(header, name_once);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("{}: corrupt safetensors header (not JSON): {}", path, e.what()));
  }
  if (twice) throw InputError(fmt::format("{}: corrupt safetensors header: tensor '{}' is named twice", path, *twice));
  if (!j.is_object()) throw InputError(fmt::format("{}: corrupt safetensors header (not a JSON object)", path));

  const std::uint64_t data_size = file_size - 8 - header_len;
  TensorMap out;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> extents;  // every tensor's [begin, end)
  for (const auto& [name, info] : j.items()) {
    if (name == "__metadata__") {  // the format's string-to-string map
      bool strings = info.is_object();
      for (const auto& [key, value] : info.items()) strings = strings && value.is_string();
      if (!strings) throw InputError(fmt::format("{}: corrupt safetensors header: __metadata__ is not a map of strings", path));
      continue;
    }
    Shape shape;
    std::uint64_t begin = 0, end = 0;
    DType dtype;
    try {
      dtype = parse_dtype(info.at("dtype").get<std::string>(), name, path);
      for (const auto& d : info.at("shape"))  // 256.5 would be read as 256
        if (!d.is_number_integer())
          throw InputError(fmt::format("{}: corrupt entry for tensor '{}': shape {} holds a dimension that is not a "
                                       "whole number", path, name, info.at("shape").dump()));
      shape = info.at("shape").get<Shape>();
      const nlohmann::json& offset_list = info.at("data_offsets");
      if (!offset_list.is_array() || offset_list.size() != 2 ||
          !std::all_of(offset_list.begin(), offset_list.end(), [](const nlohmann::json& o) { return o.is_number_unsigned(); }))
        throw InputError(fmt::format("{}: corrupt entry for tensor '{}': data_offsets {} is not two byte offsets from 0",
                                     path, name, offset_list.dump().substr(0, 100)));
      const auto offsets = offset_list.get<std::vector<std::uint64_t>>();
      begin = offsets[0];
      end = offsets[1];
    } catch (const nlohmann::json::exception&) {  // a field missing or of another type
      std::string got = info.dump();
      if (got.size() > 200) got = got.substr(0, 200) + "...";
      throw InputError(fmt::format("{}: corrupt entry for tensor '{}': the format's entry is {{\"dtype\": a string, "
                                   "\"shape\": a list of whole numbers, \"data_offsets\": [begin, end]}}, got {}",
                                   path, name, got));
    }
    std::uint64_t bytes = dtype_size(dtype);
    for (auto d : shape)
      if (d < 0 || __builtin_mul_overflow(bytes, static_cast<std::uint64_t>(d), &bytes) || bytes > data_size)
        throw InputError(fmt::format("{}: corrupt safetensors file: tensor '{}' has shape {}, more than "
                                     "the file's {} data bytes", path, name, shape_string(shape), data_size));
    if (begin <= end && end > data_size)
      throw InputError(fmt::format("{}: truncated safetensors file? tensor '{}' has data_offsets [{}, {}], past the end "
                                   "of the file's {} data bytes",
                                   path, name, begin, end, data_size));
    if (begin > end || end - begin != bytes)
      throw InputError(fmt::format(
          "{}: corrupt safetensors file: tensor '{}' ({} {}) needs {} bytes but its data_offsets "
          "[{}, {}] cover {} of the {} data bytes", path, name, dtype_name(dtype),
          shape_string(shape), bytes, begin, end, end >= begin ? end - begin : 0, data_size));
    Tensor t(shape, dtype);
    in.seekg(static_cast<std::streamoff>(8 + header_len + begin));
    if (!in.read(static_cast<char*>(t.raw()), static_cast<std::streamsize>(bytes)))
      throw InputError(fmt::format("{}: could not read the data of tensor '{}'", path, name));
    out.emplace(name, std::move(t));
    extents.emplace_back(begin, end);
  }
  // The format packs the tensors back to back over the whole data section: offsets that overlap
  // (two tensors reading the same bytes) or leave a gap are a corrupt header.
  std::sort(extents.begin(), extents.end());
  std::uint64_t at = 0;
  for (const auto& [begin, end] : extents) {
    if (begin != at)
      throw InputError(fmt::format("{}: corrupt safetensors header: the tensors' data_offsets {} at byte {} (the format "
                                   "packs them back to back from 0)",
                                   path, begin < at ? "overlap" : "leave a gap", std::min(begin, at)));
    at = end;
  }
  if (at != data_size)
    throw InputError(fmt::format("{}: corrupt safetensors file: the tensors cover {} of its {} data bytes", path, at,
                                 data_size));
  return out;
}

void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") throw InputError(fmt::format("{}: '__metadata__' is reserved, not a tensor name", path));
    header[name] = {{"dtype", dtype_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = json_text(header);
  text.append((8 - text.size() % 8) % 8, ' ');  // the format pads the header to 8 bytes
  write_file_atomically(path, [&](std::ostream& out) {
    unsigned char len_bytes[8];
    std::uint64_t len = text.size();
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
    out.write(reinterpret_cast<const char*>(len_bytes), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& [name, t] : tensors)
      out.write(static_cast<const char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
  });
}

const Tensor& expect_tensor(const TensorMap& tensors, const std::string& name, const Shape& shape,
                            const std::string& file) {
  const auto it = tensors.find(name);
  if (it == tensors.end())
    throw InputError(fmt::format("{}: tensor '{}' is missing (expected shape {}); the file has {} "
                                 "tensors, see the README's tensor layout", file, name,
                                 shape_string(shape), tensors.size()));
  const Tensor& t = it->second;
  if (t.dtype() == DType::I64)
    throw InputError(fmt::format("{}: tensor '{}' is I64; expected F32 or BF16", file, name));
  if (t.shape() != shape)
    throw InputError(fmt::format("{}: tensor '{}' has shape {}; expected {}", file, name,
                                 shape_string(t.shape()), shape_string(shape)));
  // A NaN or infinity would spread through every output it touches: named here, not found later.
  for (std::int64_t i = 0; i < t.numel(); ++i)
    if (const float v = t.get(i); !std::isfinite(v))
      throw InputError(fmt::format("{}: tensor '{}' holds {} at element {} (flat index, shape {}); the values must be "
                                   "finite",
                                   file, name, std::isnan(v) ? "NaN" : v > 0 ? "inf" : "-inf", i, shape_string(t.shape())));
  return t;
}

}  // namespace epx
