// One process per GPU for the expert-parallel tests and benchmark: the
// calling process forks `world` children; child r takes GPU r, joins an NCCL
// communicator (rank 0 makes the unique id and hands it to the others through
// pipes) and runs the body. The parent never touches CUDA (a CUDA context does
// not survive fork), so it counts GPUs in a child too.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

namespace flashmix::testing {

// NVLink multicast stays off (the machines' rule; NCCL would otherwise try NVLS).
inline void keep_multicast_off() { setenv("NCCL_NVLS_ENABLE", "0", 0); }

// The number of CUDA devices, asked in a child process (0 when there is none).
inline int gpu_count_in_child() {
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(n > 100 ? 100 : n);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

struct RanksResult {
  std::vector<int> exit_codes;  // per rank; -1: killed (timed out or crashed)
  bool timed_out = false;
  bool ok() const {
    for (int c : exit_codes)
      if (c != 0) return false;
    return !timed_out && !exit_codes.empty();
  }
  std::string describe() const {
    std::string s = timed_out ? "timed out; exit codes:" : "exit codes:";
    for (int c : exit_codes) s += " " + std::to_string(c);
    return s;
  }
};

// Runs body(rank, world, comm) on GPUs 0..world-1, one forked process each;
// its return value is the child's exit code (0: passed). Children still
// running after timeout_s are killed.
inline RanksResult run_ranks(int world, int timeout_s, const std::function<int(int, int, ncclComm_t)>& body) {
  keep_multicast_off();
  RanksResult result;
  std::vector<int> pipes(size_t(2 * world), -1);
  for (int r = 1; r < world; ++r)
    if (pipe(&pipes[size_t(2 * r)]) != 0) return result;
  fflush(stdout);
  fflush(stderr);
  std::vector<pid_t> pids(size_t(world), -1);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid < 0) break;
    if (pid > 0) {
      pids[size_t(r)] = pid;
      continue;
    }
    // Child r.
    int code = 90;
    ncclUniqueId id;
    if (r == 0) {
      if (ncclGetUniqueId(&id) != ncclSuccess) _exit(91);
      for (int q = 1; q < world; ++q)
        if (write(pipes[size_t(2 * q + 1)], &id, sizeof(id)) != ssize_t(sizeof(id))) _exit(92);
    } else {
      size_t got = 0;
      while (got < sizeof(id)) {
        const ssize_t n = read(pipes[size_t(2 * r)], reinterpret_cast<char*>(&id) + got, sizeof(id) - got);
        if (n <= 0) _exit(93);
        got += size_t(n);
      }
    }
    ncclComm_t comm = nullptr;
    if (cudaSetDevice(r) != cudaSuccess) _exit(94);
    if (ncclCommInitRank(&comm, world, id, r) != ncclSuccess) _exit(95);
    code = body(r, world, comm);
    ncclCommDestroy(comm);
    fflush(stdout);
    fflush(stderr);
    _exit(code);
  }
  for (int fd : pipes)
    if (fd >= 0) close(fd);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  result.exit_codes.assign(size_t(world), -1);
  int left = 0;
  for (pid_t p : pids) left += p > 0;
  while (left > 0) {
    int status = 0;
    const pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      for (int r = 0; r < world; ++r)
        if (pids[size_t(r)] == done) {
          result.exit_codes[size_t(r)] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
          pids[size_t(r)] = -1;
          --left;
        }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      result.timed_out = true;
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
      for (pid_t p : pids)
        if (p > 0) waitpid(p, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

}  // namespace flashmix::testing
