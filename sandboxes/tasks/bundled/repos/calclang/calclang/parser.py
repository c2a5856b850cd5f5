"""A recursive-descent parser from tokens to a list of statements.

Grammar, loosest binding first::

    statement  = let | fn | return | if | while | block | assignment | expr ";"
    expression = or
    or         = and ("or" and)*
    and        = not ("and" not)*
    not        = "not" not | comparison
    comparison = sum (("==" | "!=" | "<" | "<=" | ">" | ">=") sum)*
    sum        = product (("+" | "-") product)*
    product    = unary (("*" | "/" | "%") unary)*
    unary      = "-" unary | power
    power      = call ("**" unary)?
    call       = primary ("(" args ")")*
"""

from calclang import ast
from calclang.errors import ParseError
from calclang.lexer import Token

COMPARISON_OPS = ("==", "!=", "<", "<=", ">", ">=")


class _Parser:
    def __init__(self, tokens: list[Token]):
        self.tokens = tokens
        self.index = 0

    def peek(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.tokens[self.index]
        if token.kind != "eof":
            self.index += 1
        return token

    def check(self, text: str) -> bool:
        token = self.peek()
        return token.kind in ("op", "keyword") and token.text == text

    def match(self, *texts: str) -> Token | None:
        for text in texts:
            if self.check(text):
                return self.advance()
        return None

    def expect(self, text: str, context: str) -> Token:
        if self.check(text):
            return self.advance()
        found = self.peek().text or "end of input"
        raise ParseError(f"expected '{text}' {context}, found '{found}'", self.peek().line)

    def expect_name(self, context: str) -> str:
        token = self.peek()
        if token.kind != "name":
            raise ParseError(f"expected a name {context}, found '{token.text}'", token.line)
        return self.advance().text

    def program(self) -> list[ast.Node]:
        statements = []
        while self.peek().kind != "eof":
            statements.append(self.statement())
        return statements

    def statement(self) -> ast.Node:
        line = self.peek().line
        if self.match("let"):
            name = self.expect_name("after 'let'")
            self.expect("=", f"after 'let {name}'")
            value = self.expression()
            self.expect(";", "after a let statement")
            return ast.Let(line, name, value)
        if self.match("fn"):
            return self.function(line)
        if self.match("return"):
            value = None if self.check(";") else self.expression()
            self.expect(";", "after return")
            return ast.Return(line, value)
        if self.match("if"):
            return self.if_statement(line)
        if self.match("while"):
            condition = self.parenthesized("while")
            return ast.While(line, condition, self.block())
        if self.check("{"):
            return self.block()
        if self.peek().kind == "name" and self.tokens[self.index + 1].text == "=":
            name = self.advance().text
            self.advance()
            value = self.expression()
            self.expect(";", "after an assignment")
            return ast.Assign(line, name, value)
        expr = self.expression()
        self.expect(";", "after an expression")
        return ast.ExprStmt(line, expr)

    def function(self, line: int) -> ast.FunctionDef:
        name = self.expect_name("after 'fn'")
        self.expect("(", f"after 'fn {name}'")
        params = []
        if not self.check(")"):
            params.append(self.expect_name("as a parameter"))
            while self.match(","):
                params.append(self.expect_name("as a parameter"))
        self.expect(")", "after the parameters")
        return ast.FunctionDef(line, name, params, self.block())

    def if_statement(self, line: int) -> ast.If:
        condition = self.parenthesized("if")
        then = self.block()
        otherwise = None
        if self.match("else"):
            otherwise = self.if_statement(self.peek().line) if self.match("if") else self.block()
        return ast.If(line, condition, then, otherwise)

    def parenthesized(self, keyword: str) -> ast.Node:
        self.expect("(", f"after '{keyword}'")
        condition = self.expression()
        self.expect(")", f"after the {keyword} condition")
        return condition

    def block(self) -> ast.Block:
        line = self.expect("{", "to start a block").line
        body = []
        while not self.check("}"):
            if self.peek().kind == "eof":
                raise ParseError("block is never closed with '}'", line)
            body.append(self.statement())
        self.advance()
        return ast.Block(line, body)

    def expression(self) -> ast.Node:
        return self.logical_or()

    def logical_or(self) -> ast.Node:
        left = self.logical_and()
        while token := self.match("or"):
            left = ast.Logical(token.line, "or", left, self.logical_and())
        return left

    def logical_and(self) -> ast.Node:
        left = self.logical_not()
        while token := self.match("and"):
            left = ast.Logical(token.line, "and", left, self.logical_not())
        return left

    def logical_not(self) -> ast.Node:
        if token := self.match("not"):
            return ast.Unary(token.line, "not", self.logical_not())
        return self.comparison()

    def comparison(self) -> ast.Node:
        left = self.sum()
        while token := self.match(*COMPARISON_OPS):
            left = ast.Binary(token.line, token.text, left, self.sum())
        return left

    def sum(self) -> ast.Node:
        left = self.product()
        while token := self.match("+", "-"):
            left = ast.Binary(token.line, token.text, left, self.product())
        return left

    def product(self) -> ast.Node:
        left = self.unary()
        while token := self.match("*", "/", "%"):
            left = ast.Binary(token.line, token.text, left, self.unary())
        return left

    def unary(self) -> ast.Node:
        if token := self.match("-"):
            return ast.Unary(token.line, "-", self.unary())
        return self.power()

    def power(self) -> ast.Node:
        base = self.call()
        if token := self.match("**"):
            # Right-associative, and the exponent may itself be negative: 2 ** -1.
            return ast.Binary(token.line, "**", base, self.unary())
        return base

    def call(self) -> ast.Node:
        expr = self.primary()
        while token := self.match("("):
            args = []
            if not self.check(")"):
                args.append(self.expression())
                while self.match(","):
                    args.append(self.expression())
            self.expect(")", "after the arguments")
            expr = ast.Call(token.line, expr, args)
        return expr

    def primary(self) -> ast.Node:
        token = self.advance()
        if token.kind in ("number", "string"):
            return ast.Literal(token.line, token.value)
        if token.kind == "keyword" and token.text in ("true", "false", "nil"):
            return ast.Literal(token.line, {"true": True, "false": False, "nil": None}[token.text])
        if token.kind == "name":
            return ast.Variable(token.line, token.text)
        if token.kind == "op" and token.text == "(":
            expr = self.expression()
            self.expect(")", "to close '('")
            return expr
        found = token.text or "end of input"
        raise ParseError(f"expected an expression, found '{found}'", token.line)


def parse(tokens: list[Token]) -> list[ast.Node]:
    """Parse a whole program into its list of statements."""
    return _Parser(tokens).program()
