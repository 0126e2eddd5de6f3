// Errors about user input that is not a config: tensor files, shapes, dtypes. The message names
// the file or tensor, the value found and what was expected; the CLI prints it and exits 2.
#pragma once

#include <stdexcept>
#include <string>

namespace epx {

class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& what) : std::runtime_error(what) {}
};

// The environment cannot run what the config asks for: a backend this build does not include,
// ranks that do not share memory where a shared window needs them. The CLI exits 5.
class EnvironmentError : public std::runtime_error {
 public:
  explicit EnvironmentError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace epx
