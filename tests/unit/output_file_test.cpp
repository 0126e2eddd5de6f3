// Output files: what check_output_path refuses, and write_file_atomically through a link.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "epx/base/error.hpp"
#include "epx/base/output_file.hpp"
#include "test_support.hpp"

namespace fs = std::filesystem;

namespace epx {
namespace {

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("epx_output_file_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(OutputFile, RefusesWhatTheRenameWouldReplace) {
  TempDir dir;
  const fs::path fifo = dir.path / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string fifo_error = test::error_of<InputError>([&] { check_output_path(fifo.string(), "-o"); });
  EXPECT_NE(fifo_error.find("not a regular file"), std::string::npos) << fifo_error;
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_THROW(check_output_path(dir.path.string(), "-o"), InputError);
  EXPECT_THROW(check_output_path((dir.path / "missing" / "x.html").string(), "-o"), InputError);
  fs::create_symlink("loop_b", dir.path / "loop_a");
  fs::create_symlink("loop_a", dir.path / "loop_b");
  EXPECT_THROW(check_output_path((dir.path / "loop_a").string(), "-o"), InputError);  // it failed only at the write
  EXPECT_NO_THROW(check_output_path((dir.path / "new.html").string(), "-o"));
  EXPECT_FALSE(fs::exists(dir.path / "new.html"));  // nothing created that stays
}

TEST(OutputFile, WritesThroughALink) {
  TempDir dir;
  fs::create_directories(dir.path / "real");
  const fs::path target = dir.path / "real" / "out.json", link = dir.path / "link.json";
  std::ofstream(target) << "old";
  fs::create_symlink("real/out.json", link);
  check_output_path(link.string(), "--results");
  write_file_atomically(link.string(), [](std::ostream& out) { out << "new"; });
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(slurp(target), "new");
  // A link to a file not there yet: the file is created where the link points.
  const fs::path dangling = dir.path / "dangling.json";
  fs::create_symlink("real/later.json", dangling);
  check_output_path(dangling.string(), "--results");
  write_file_atomically(dangling.string(), [](std::ostream& out) { out << "later"; });
  EXPECT_TRUE(fs::is_symlink(dangling));
  EXPECT_EQ(slurp(dir.path / "real" / "later.json"), "later");
}

}  // namespace
}  // namespace epx
