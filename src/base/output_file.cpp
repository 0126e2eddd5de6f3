#include "epx/base/output_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "epx/base/error.hpp"

namespace epx {
namespace {

namespace fs = std::filesystem;

fs::path directory_of(const std::string& path) {
  const fs::path dir = fs::path(path).parent_path();
  return dir.empty() ? fs::path(".") : dir;
}

// A new, empty file beside `path` (mkstemp: no clash with another writer); its name.
std::string create_temporary(const std::string& path, const std::string& option) {
  std::string name = (directory_of(path) / ("." + fs::path(path).filename().string() + ".XXXXXX"))
                         .string();
  const int fd = ::mkstemp(name.data());
  if (fd < 0)
    throw InputError(fmt::format("{} {}: cannot create a file in {}: {}", option, path,
                                 directory_of(path).string(), std::strerror(errno)));
  // mkstemp makes it 0600; give it the mode a plain create would have (0666 less the umask).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd, 0666 & ~mask);
  ::close(fd);
  return name;
}

// Where `path` leads, following links even where the file they name does not exist yet (then
// weakly_canonical alone stops at the link).
fs::path resolved(fs::path path) {
  std::error_code ec;
  for (int hops = 0; hops < 40 && fs::is_symlink(path, ec); ++hops) {
    const fs::path target = fs::read_symlink(path, ec);
    if (ec) break;
    path = target.is_absolute() ? target : path.parent_path() / target;
  }
  return fs::weakly_canonical(path, ec);
}

// The file a write of `path` replaces: through a link, its target (the link stays a link).
std::string written_file(const std::string& path) {
  std::error_code ec;
  return fs::is_symlink(path, ec) ? resolved(path).string() : path;
}

}  // namespace

std::string json_text(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

void check_output_path(const std::string& path, const std::string& option, const std::vector<NamedPath>& others) {
  if (path.empty()) throw InputError(fmt::format("{}: the path is empty", option));
  std::error_code ec;
  for (const NamedPath& other : others) {
    const bool same = fs::exists(path, ec) && fs::exists(other.path, ec)
                          ? fs::equivalent(path, other.path, ec)  // hard links too
                          : resolved(path) == resolved(other.path);
    if (same)
      throw InputError(fmt::format("{} {}: the same file as {} {}; writing it would replace that; choose another path",
                                   option, path, other.name, other.path));
  }
  if (fs::is_directory(path, ec))
    throw InputError(fmt::format("{} {}: is a directory; give a file path such as {}/{}", option, path, path,
                                 option == "--trace"     ? "trace.json"
                                 : option == "--results" ? "results.json"
                                 : option == "-o"        ? "report.html"
                                                         : "file.safetensors"));
  // A device, FIFO or socket would be replaced by the renamed file (as root, /dev/null itself).
  const fs::file_status status = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)  // a loop of links, a component that is a file
    throw InputError(fmt::format("{} {}: {}; give a file path", option, path, ec.message()));
  if (fs::exists(status) && !fs::is_regular_file(status))
    throw InputError(fmt::format("{} {}: is not a regular file (a device, FIFO or socket); epx writes an output whole "
                                 "and renames it into place, which would replace it; give a file path",
                                 option, path));
  const fs::path dir = directory_of(written_file(path));
  if (!fs::is_directory(dir, ec))
    throw InputError(fmt::format("{} {}: the directory {} does not exist; create it (mkdir -p {}) "
                                 "or choose another path",
                                 option, path, dir.string(), dir.string()));
  // Permissions alone do not tell (root ignores them, a read-only mount does not show in them):
  // create a file there and remove it.
  const std::string probe = create_temporary(written_file(path), option);
  fs::remove(probe, ec);
}

void write_file_atomically(const std::string& path,
                           const std::function<void(std::ostream&)>& write) {
  const std::string file = written_file(path);
  const std::string tmp = create_temporary(file, "writing");
  const auto fail = [&](const std::string& why) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw InputError(fmt::format("cannot write {}: {}; nothing was written", path, why));
  };
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail(std::strerror(errno));
    write(out);
    out.flush();
    if (!out) fail(errno ? std::strerror(errno) : "the write failed (disk full?)");
  }
  // Data the file system accepted lazily can still fail here (delayed allocation).
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    fail(std::strerror(err));
  }
  ::close(fd);
  std::error_code ec;
  fs::rename(tmp, file, ec);
  if (ec) fail(ec.message());
}

}  // namespace epx
