// Output files (results, traces, tensors): checked before any work starts, written whole or not
// at all, and JSON that is always valid whatever bytes the user's input carried.
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace epx {

// JSON text; string bytes that are not UTF-8 (from a config value or a path) become U+FFFD
// rather than failing the dump. indent < 0: one line.
std::string json_text(const nlohmann::json& j, int indent = -1);

// A file the command reads or writes besides an output, for check_output_path: what names it
// ("--weights", "RUN") and its path.
struct NamedPath {
  std::string name, path;
};

// Refuses (InputError, naming `option` and the path) an output that could not be written: a path
// that is a directory, a device, FIFO or socket, a directory that does not exist, or one where no
// file can be created (permissions, a read-only file system); or one that is the same file as one
// of `others` (an input it would replace, another output), through links too. Creates nothing
// that stays.
void check_output_path(const std::string& path, const std::string& option,
                       const std::vector<NamedPath>& others = {});

// Writes `path` whole or not at all: into a new temporary file beside it, flushed and synced,
// then renamed over it (over a link's target: the link stays). On any failure (a full disk) the
// temporary is removed, `path` is left as it was, and InputError names the path and the reason.
void write_file_atomically(const std::string& path,
                           const std::function<void(std::ostream&)>& write);

}  // namespace epx
