// Package readmecheck checks that the Go code blocks of the README and of
// the guides under docs/ compile against the module's packages as they are.
package readmecheck

import (
	"bufio"
	"context"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// imports are the packages a block may use without importing them.
var imports = []string{
	"context", "crypto/tls", "crypto/x509", "errors", "fmt", "log", "log/slog", "net/http", "os", "testing", "time",
	"github.com/etcdsync/etcdsync",
	"github.com/etcdsync/etcdsync/etcdsynctest",
	"github.com/prometheus/client_golang/prometheus",
	"go.etcd.io/etcd/client/v3",
	"go.uber.org/zap",
}

// preamble declares what the blocks use from the text around them: a
// context, a client, a session, a held Mutex, an Election, an Observer, a test, and the
// user's own functions.
const preamble = `
var (
	t     *testing.T
	ctx   context.Context
	cli   *clientv3.Client
	s     *etcdsync.Session
	m     *etcdsync.Mutex
	e     *etcdsync.Election
	o     *etcdsync.Observer
	today string
	next  string
	tick  <-chan time.Time
)

func report(ctx context.Context, token int64) error          { return nil }
func work(ctx context.Context, token int64) <-chan struct{} { return nil }
func transfer(ctx context.Context, from, to string, amount, token int64) error { return nil }
func render(ctx context.Context, cfg []byte) error { return nil }
func runPhase(ctx context.Context) error { return nil }
func write(ctx context.Context, token int64, data string) error { return nil }
`

// block is a Go code block of a Markdown file and the file's line of its
// first line.
type block struct {
	line int
	code string
}

// goBlocks returns the ```go blocks of a Markdown file.
func goBlocks(r io.Reader) ([]block, error) {
	var out []block
	sc := bufio.NewScanner(r)
	var cur *block
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case cur == nil && strings.TrimSpace(line) == "```go":
			cur = &block{line: n + 1}
		case cur != nil && strings.TrimSpace(line) == "```":
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			cur.code += line + "\n"
		}
	}
	return out, sc.Err()
}

// TestReadmeGoBlocksCompile type-checks every Go block of the README and
// of each guide (docs/*.md), a file at a time, each block as the body of a
// function, "..." standing for error handling. Variables a block declares
// and does not use are allowed (the prose goes on with them).
func TestReadmeGoBlocksCompile(t *testing.T) {
	guides, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	exports := exportData(t)
	for _, path := range append([]string{"../../README.md"}, guides...) {
		name, _ := filepath.Rel("../..", path)
		t.Run(name, func(t *testing.T) {
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			blocks, err := goBlocks(f)
			if err != nil {
				t.Fatal(err)
			}
			if name == "README.md" && len(blocks) == 0 {
				t.Fatalf("found %d Go blocks in the README; the parser is wrong", len(blocks))
			}
			for _, p := range typeCheck(name, blocks, exports) {
				t.Error(p)
			}
		})
	}
}

// typeCheck type-checks the blocks of the Markdown file name as one
// package, each block the body of a function, and returns the problems
// found, with their lines in the file.
func typeCheck(name string, blocks []block, exports map[string]string) []string {
	var src strings.Builder
	src.WriteString("package readme\n\nimport (\n")
	for _, p := range imports {
		fmt.Fprintf(&src, "\t%s\n", strconv.Quote(p))
	}
	src.WriteString(")\n" + preamble)
	for i, b := range blocks {
		code := strings.ReplaceAll(b.code, "{ ... }", "{ panic(err) }")
		fmt.Fprintf(&src, "\nfunc block%d() {\n//line %s:%d\n%s}\n", i, name, b.line, code)
	}
	fset := token.NewFileSet()
	file, err := parser.ParseFile(fset, "readme.go", src.String(), parser.ParseComments)
	if err != nil {
		return []string{fmt.Sprintf("%s: Go blocks do not parse: %v", name, err)}
	}
	lookup := func(path string) (io.ReadCloser, error) {
		if e, ok := exports[path]; ok {
			return os.Open(e)
		}
		return nil, fmt.Errorf("no export data for %s", path)
	}
	var problems []string
	conf := types.Config{
		Importer: importer.ForCompiler(fset, "gc", lookup),
		Error: func(err error) {
			msg := err.Error()
			if strings.Contains(msg, "declared and not used") || strings.Contains(msg, "imported and not used") {
				return
			}
			problems = append(problems, msg)
		},
	}
	conf.Check("readme", fset, []*ast.File{file}, nil)
	return problems
}

// exportData builds the imports and the packages they need and returns
// where their export data is.
func exportData(t *testing.T) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	args := append([]string{"list", "-export", "-deps", "-f", "{{.ImportPath}} {{.Export}}"}, imports...)
	out, err := exec.CommandContext(ctx, "go", args...).Output()
	if err != nil {
		t.Fatalf("go list -export: %v", err)
	}
	exports := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if path, file, ok := strings.Cut(line, " "); ok && file != "" {
			exports[path] = file
		}
	}
	return exports
}
