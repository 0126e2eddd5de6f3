// Finding recipes by name.
#include <algorithm>
#include <cstdlib>
#include <unistd.h>

#include <fmt/format.h>

#include "epx/base/env.hpp"
#include "epx/config/config.hpp"
#include "epx/config/schema.hpp"

namespace epx {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> recipe_dirs() {
  std::vector<fs::path> dirs;
  std::error_code ec;
  if (const auto dir = env_path(env::kRecipesDir)) {  // the user's: never passed over in silence
    if (!fs::is_directory(*dir, ec))
      throw ConfigError(fmt::format("{}={}: not a directory of recipes; set it to one, or unset it for the recipes "
                                    "shipped with epx",
                                    env::kRecipesDir, *dir));
    dirs.emplace_back(*dir);
  }
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    dirs.push_back(exe.parent_path() / "../share/epx/recipes");
    dirs.push_back(exe.parent_path() / "../recipes");
  }
#ifdef EPX_SOURCE_RECIPES_DIR
  dirs.emplace_back(EPX_SOURCE_RECIPES_DIR);
#endif
  return dirs;
}

}  // namespace

std::vector<std::string> list_recipes() {
  std::vector<std::string> names;
  for (const auto& dir : recipe_dirs()) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.path().extension() == ".yaml") names.push_back(entry.path().stem().string());
    if (!names.empty()) break;  // the first directory that has recipes wins
  }
  std::sort(names.begin(), names.end());
  return names;
}

fs::path resolve_recipe(const std::string& name_or_path) {
  // Status errors (a name over the file-system limit, a path through a file) mean "not found";
  // the message quotes at most the start of a long name.
  const auto is_file = [](const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec);
  };
  const fs::path as_path(name_or_path);
  if (name_or_path.empty()) throw ConfigError("the config name is empty: name a recipe or a file");
  if (name_or_path.find('/') != std::string::npos || as_path.extension() == ".yaml" ||
      as_path.extension() == ".yml") {
    std::error_code ec;
    if (fs::is_directory(as_path, ec))
      throw ConfigError(fmt::format("{}: is a directory, not a config file", name_or_path));
    // Not only regular files: `epx check <(...)` reads a pipe (read_config_text bounds the read).
    if (!fs::exists(as_path, ec)) {
      (void)fs::status(as_path, ec);  // why it is not there, when the system says
      throw ConfigError(fmt::format("{}: no such file{}", shorten(name_or_path, 200),
                                    ec ? " (" + ec.message() + ")" : ""));
    }
    return as_path;
  }
  for (const auto& dir : recipe_dirs()) {
    const fs::path candidate = dir / (name_or_path + ".yaml");
    if (is_file(candidate)) return fs::weakly_canonical(candidate);
  }
  // Not a recipe: a file or folder of that name here (a config without .yaml, a typo'd folder).
  if (is_file(as_path)) return as_path;
  std::error_code ec;
  if (fs::is_directory(as_path, ec))
    throw ConfigError(fmt::format("{}: is a directory, not a config file (and no recipe has that name)", name_or_path));
  throw ConfigError(fmt::format("no recipe named '{}'; shipped recipes: {} (or give a path to "
                                "a YAML file)",
                                shorten(name_or_path, 200), fmt::join(list_recipes(), ", ")));
}

}  // namespace epx
