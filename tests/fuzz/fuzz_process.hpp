// What the seeded fuzzers share: running epx as a separate process with a time limit, its exit
// code and output kept, and the environment that makes a sanitizer's report fail a case.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fuzz {

namespace fs = std::filesystem;

struct Outcome {
  int code = -1;       // exit code; -1: killed by a signal or the time limit
  bool timed_out = false;
  std::string out, err;
};

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline Outcome run(const std::vector<std::string>& argv, const fs::path& dir, double time_limit_s) {
  const fs::path out = dir / "stdout", err = dir / "stderr";
  const pid_t pid = fork();
  if (pid == 0) {
    const int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(o, 1);
    dup2(e, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  Outcome r;
  if (pid < 0) return r;  // no process: a failure (code -1), not an exit 0
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  for (pid_t w; (w = waitpid(pid, &status, WNOHANG)) != pid;) {
    if (w < 0 && errno != EINTR) return r;
    if (std::chrono::steady_clock::now() - start > std::chrono::duration<double>(time_limit_s)) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (!r.timed_out && WIFEXITED(status)) r.code = WEXITSTATUS(status);
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

// Sanitizer reports must not pass for a clean exit 1.
inline void fail_on_sanitizer_reports() {
  const auto append_env = [](const char* name, const char* extra) {
    const char* old = std::getenv(name);
    setenv(name, (std::string(old ? old : "") + (old && *old ? ":" : "") + extra).c_str(), 1);
  };
  append_env("ASAN_OPTIONS", "exitcode=86");
  append_env("UBSAN_OPTIONS", "exitcode=87");
}

}  // namespace fuzz
