// Every error epx reports to its user, and the exit code each ends in. The message names the
// field, file or variable, the value found, why it is wrong and what to set instead; the CLI
// prints it and exits with the code below. Anything else that escapes is a bug in epx (exit 3).
#pragma once

#include <stdexcept>
#include <string>

namespace epx {

// Exit codes of `epx` and of every rank of a job.
enum ExitCode : int {
  kExitOk = 0,
  kExitCheckFailed = 1,  // the config has errors (epx check's verdict)
  kExitBadInput = 2,     // ConfigError, InputError: input that cannot be used at all
  kExitInternal = 3,     // a bug in epx
  kExitCommTimeout = 4,  // a collective or the job's start-up did not complete in time, or failed in flight
  kExitEnvironment = 5,  // EnvironmentError
  kExitDiverged = 6,     // TrainingDiverged
};

// Bad config input: malformed YAML, a wrong type, an unknown key, a value epx cannot run, a bad
// environment knob. The message starts with the place ("file:line:col: key", or `key=value`).
class ConfigError : public std::runtime_error {
 public:
  explicit ConfigError(const std::string& what) : std::runtime_error(what) {}
};

// Bad input that is not a config: tensor files, shapes, dtypes, output paths. The message names
// the file or tensor, the value found and what was expected.
class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& what) : std::runtime_error(what) {}
};

// The environment cannot run what the config asks for: a backend this build does not include,
// ranks that do not share memory where a shared window needs them.
class EnvironmentError : public std::runtime_error {
 public:
  explicit EnvironmentError(const std::string& what) : std::runtime_error(what) {}
};

// The training's loss became NaN or infinite: Megatron's check_for_nan_in_loss (on by default)
// stops the run there, and so does epx run. Every rank sees the same reduced loss and stops.
class TrainingDiverged : public std::runtime_error {
 public:
  explicit TrainingDiverged(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace epx
